// Small helpers shared by the dashboard's modules: DOM building (never innerHTML with data from the
// network, so a node name cannot inject markup), number formatting, and stable per-node colours.

const SVG_NS = "http://www.w3.org/2000/svg";

// h("div", {class: "x", "data-id": id}, child, "text", [more children]) -> an element.
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  return fill(el, attrs, children);
}

export function s(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  return fill(el, attrs, children);
}

function fill(el, attrs, children) {
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

// Replace an element's children in one go.
export function replace(el, ...children) {
  el.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
}

const UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];

export function formatBytes(bytes) {
  if (bytes === null || bytes === undefined) return "–";
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < UNITS.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return unit === 0 ? `${value} B` : `${value.toFixed(1)} ${UNITS[unit]}`;
}

export function formatRate(tokensPerSecond) {
  if (!tokensPerSecond) return "0 tok/s";
  const digits = tokensPerSecond >= 100 ? 0 : 1;
  return `${tokensPerSecond.toFixed(digits)} tok/s`;
}

export function formatSeconds(seconds) {
  return seconds < 1 ? `${Math.round(seconds * 1000)} ms` : `${seconds.toFixed(2)} s`;
}

// Layers [start, end) as people count them: "0–3", or a single "6".
export function formatLayers(start, end) {
  return end - start === 1 ? `${start}` : `${start}–${end - 1}`;
}

// A parameter count as people write it: 135M, 1.0B, 30.5B.
export function formatCount(count) {
  if (count >= 1e9) return `${(count / 1e9).toFixed(1)}B`;
  if (count >= 1e6) return `${Math.round(count / 1e6)}M`;
  if (count >= 1e3) return `${Math.round(count / 1e3)}K`;
  return `${count}`;
}

export function plural(count, word) {
  return `${count} ${word}${count === 1 ? "" : "s"}`;
}

// Vivid and far apart; no red (that means trouble here) and no grey (that means gone).
const PALETTE = ["#4f9cf9", "#f5a442", "#3ecf8e", "#c678dd", "#e5c07b", "#56b6c2", "#ff7eb6", "#a3e635"];
let colours = new Map();

// Colours come from the node ids alone, so every node's page colours the cluster the same way and a node
// keeps its colour when others leave. Ids are visited in sorted order and a taken colour moves to the next
// free one, so up to eight nodes always get different colours.
export function assignColours(nodeIds) {
  const taken = new Set();
  colours = new Map();
  for (const id of [...nodeIds].sort()) {
    let slot = hash(id) % PALETTE.length;
    for (let tries = 0; taken.has(slot) && tries < PALETTE.length; tries += 1) slot = (slot + 1) % PALETTE.length;
    taken.add(slot);
    colours.set(id, PALETTE[slot]);
  }
}

export function colourOf(nodeId) {
  return colours.get(nodeId) || "#8b98a9";
}

function hash(text) {
  let value = 5381;
  for (const char of text) value = (value * 33 + char.codePointAt(0)) >>> 0;
  return value;
}

// What an instance is called on the page: its model as GET /v1/models lists it (the key, a path or repo@commit,
// when the node has no name for it), and "#n" for a second instance of the same model.
export function instanceName(instance) {
  const name = instance.model_name || instance.model;
  const copy = instance.id.startsWith(`${instance.model}#`) ? instance.id.slice(instance.model.length) : "";
  return `${name}${copy}`;
}

// Minutes and seconds, for a keep-alive countdown: "4 min 05 s", "42 s".
export function formatCountdown(seconds) {
  const whole = Math.max(0, Math.round(seconds));
  if (whole < 60) return `${whole} s`;
  if (whole < 3600) return `${Math.floor(whole / 60)} min ${String(whole % 60).padStart(2, "0")} s`;
  return `${Math.floor(whole / 3600)} h ${String(Math.floor((whole % 3600) / 60)).padStart(2, "0")} min`;
}

// The message of an error the node answered with (its own words), else the HTTP status line.
export async function errorText(response) {
  try {
    const body = await response.json();
    if (body.error && body.error.message) return body.error.message;
  } catch (error) {
    // not JSON: fall through to the status line
  }
  return response.statusText || "no details";
}
