// The ring: an SVG of the nodes in pipeline order with arrows the way tokens flow, the node cards beside it,
// and the bar of all layers split between the nodes.

import { colourOf, formatBytes, formatLayers, formatRate, h, plural, replace, s } from "./util.js";

const STATUS_LABELS = {
  ready: "ready",
  busy: "busy",
  loading: "loading layers",
  joining: "joining",
  idle: "idle",
  problem: "can't serve",
  unreachable: "unreachable",
  downloading: "downloading",
};
const SLOW_STEP_SECONDS = 10;  // one engine step (a token, a prefill chunk) this long is worth showing: hung?

// The status people need: a ready node computing right now is "busy"; one that reports a problem (its
// layers do not fit, or failed to load) will not finish loading, so it does not say "loading".
export function displayStatus(node) {
  if (node.status === "ready" && node.step_seconds >= SLOW_STEP_SECONDS) return "slow-step";
  if (node.status === "ready") return node.busy ? "busy" : "ready";
  if (node.problem) return "problem";
  if (node.download && node.download.state === "downloading") return "downloading";
  return node.status;
}

// The pill's words: a downloading node says how far it is.
export function statusLabel(node, status) {
  if (status === "downloading") return `downloading ${Math.floor(node.download.percent)} %`;
  if (status === "slow-step") return `one step for ${Math.floor(node.step_seconds)} s`;
  return STATUS_LABELS[status] || status;
}

// Nodes in pipeline order (the plan's stages), then members the plan does not use yet.
export function ringOrder(picture) {
  const byId = new Map(picture.nodes.map((node) => [node.id, node]));
  const stages = picture.plan ? picture.plan.stages : [];
  const inRing = stages.map((stage) => byId.get(stage.node_id)).filter(Boolean);
  const others = picture.nodes.filter((node) => !stages.some((stage) => stage.node_id === node.id));
  return [...inRing, ...others];
}

export function stageOf(picture, nodeId) {
  return picture.plan ? picture.plan.stages.find((stage) => stage.node_id === nodeId) || null : null;
}

// -- SVG ring ---------------------------------------------------------------------------------------------

const SIZE = 320;
const CENTRE = SIZE / 2;
const RADIUS = 108;
const NODE_RADIUS = 34;
const LABEL_DISTANCE = RADIUS + NODE_RADIUS + 12; // the "you" label sits outside the ring, clear of the arrows
const SIDE = 26; // room beside the square for a label next to a node on the left or right

export function renderRing(container, picture) {
  const nodes = ringOrder(picture);
  const flowing = picture.requests_in_flight > 0;
  const points = nodes.map((_, i) => angleAt(i, nodes.length));
  const svg = s("svg", { viewBox: viewBox(nodes.length), role: "img", "aria-label": ringLabel(nodes) },
    s("defs", {}, s("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 7, refY: 5, markerWidth: 6,
      markerHeight: 6, orient: "auto-start-reverse" }, s("path", { d: "M0,0 L10,5 L0,10 z", class: "arrow-head" }))),
    nodes.length === 1 ? loopArrow(flowing) : points.map((angle, i) =>
      arcArrow(angle, points[(i + 1) % points.length], flowing)),
    centreText(picture, nodes.length),
    nodes.map((node, i) => nodeBubble(node, picture, nodes.length === 1 ? null : points[i])));
  replace(container, svg);
}

// Crop what the drawing leaves empty (a ring of three has nothing below its lowest arc).
function viewBox(count) {
  if (count === 1) {
    const reach = NODE_RADIUS + 30; // the loop arrow around the single bubble
    return `0 ${CENTRE - reach} ${SIZE} ${2 * reach}`;
  }
  const ys = [CENTRE - RADIUS - 4, CENTRE + RADIUS + 4];
  for (let i = 0; i < count; i += 1) {
    const angle = angleAt(i, count);
    const y = pointAt(angle)[1];
    const labelY = pointAt(angle, LABEL_DISTANCE)[1];
    ys.push(y - NODE_RADIUS - 4, y + NODE_RADIUS + 4, labelY - 8, labelY + 8);
  }
  const top = Math.floor(Math.min(...ys));
  return `${-SIDE} ${top} ${SIZE + 2 * SIDE} ${Math.ceil(Math.max(...ys)) - top}`;
}

function ringLabel(nodes) {
  return `Ring of ${plural(nodes.length, "node")}: ${nodes.map((node) => node.name).join(" → ")}`;
}

function angleAt(index, count) {
  return -Math.PI / 2 + (2 * Math.PI * index) / count;
}

function pointAt(angle, radius = RADIUS) {
  return [CENTRE + radius * Math.cos(angle), CENTRE + radius * Math.sin(angle)];
}

// An arc along the ring from one node to the next, stopping short of both bubbles.
function arcArrow(from, to, flowing) {
  const gap = (NODE_RADIUS + 8) / RADIUS;
  const end = to <= from ? to + 2 * Math.PI : to;
  const [x1, y1] = pointAt(from + gap);
  const [x2, y2] = pointAt(end - gap);
  const large = end - from - 2 * gap > Math.PI ? 1 : 0;
  const d = `M${x1.toFixed(1)},${y1.toFixed(1)} A${RADIUS},${RADIUS} 0 ${large} 1 ${x2.toFixed(1)},${y2.toFixed(1)}`;
  return s("path", { d, class: flowing ? "link flowing" : "link", "marker-end": "url(#arrow)" });
}

// A ring of one: the node feeds itself.
function loopArrow(flowing) {
  const r = NODE_RADIUS + 22;
  const [x1, y1] = [CENTRE + r * Math.cos(-1.2), CENTRE + r * Math.sin(-1.2)];
  const [x2, y2] = [CENTRE + r * Math.cos(-1.9), CENTRE + r * Math.sin(-1.9)];
  const d = `M${x1.toFixed(1)},${y1.toFixed(1)} A${r},${r} 0 1 1 ${x2.toFixed(1)},${y2.toFixed(1)}`;
  return s("path", { d, class: flowing ? "link flowing" : "link", "marker-end": "url(#arrow)" });
}

function centreText(picture, count) {
  if (count === 1) return null; // the single bubble sits in the centre
  return s("g", { class: "centre" },
    s("text", { x: CENTRE, y: CENTRE - 4, class: "centre-big" }, formatRate(picture.tokens_per_second)),
    s("text", { x: CENTRE, y: CENTRE + 16, class: "centre-small" }, "tokens flow clockwise"));
}

function nodeBubble(node, picture, angle) {
  const [x, y] = angle === null ? [CENTRE, CENTRE] : pointAt(angle);
  const stage = stageOf(picture, node.id);
  const me = node.id === picture.node_id;
  const status = displayStatus(node);
  return s("g", { class: `bubble status-${status}${me ? " me" : ""}`, "data-node-id": node.id,
    style: `--node: ${colourOf(node.id)}` },
    me ? s("circle", { cx: x, cy: y, r: NODE_RADIUS + 6, class: "halo" }) : null,
    s("circle", { cx: x, cy: y, r: NODE_RADIUS, class: "disc" }),
    s("text", { x, y: y - 2, class: "bubble-name" }, shorten(node.name, 10)),
    s("text", { x, y: y + 13, class: "bubble-layers" },
      stage ? `L ${formatLayers(stage.start_layer, stage.end_layer)}` : "no layers"),
    me ? youLabel(x, y, angle) : null,
    s("title", {}, `${node.name} (${node.address})`));
}

function youLabel(x, y, angle) {
  if (angle === null) return s("text", { x, y: y - NODE_RADIUS - 11, class: "bubble-you" }, "you");
  const [lx, ly] = pointAt(angle, LABEL_DISTANCE);
  const cos = Math.cos(angle);
  const anchor = cos > 0.3 ? "start" : cos < -0.3 ? "end" : "middle";
  // Inline style: the stylesheet centres bubble text, and a presentation attribute would lose to it.
  return s("text", { x: lx, y: ly, class: "bubble-you", style: `text-anchor: ${anchor}`,
    "dominant-baseline": "middle" }, "you");
}

function shorten(text, max) {
  return text.length > max ? `${text.slice(0, max - 1)}…` : text;
}

// -- node cards -------------------------------------------------------------------------------------------

export function renderNodeCards(list, picture) {
  const cards = ringOrder(picture).map((node) => nodeCard(node, picture));
  const gone = picture.departed.map((node) => departedCard(node));
  replace(list, cards, gone);
}

function nodeCard(node, picture) {
  const stage = stageOf(picture, node.id);
  const status = displayStatus(node);
  const nLayers = picture.plan ? picture.plan.n_layers : 0;
  return h("li", { class: `node status-${status}`, "data-node-id": node.id, "data-status": status,
    "data-start": stage ? stage.start_layer : null, "data-end": stage ? stage.end_layer : null,
    style: `--node: ${colourOf(node.id)}` },
    cardHead(node, status, node.id === picture.node_id),
    h("div", { class: "node-sub" },
      h("span", { class: "node-device" }, deviceText(node)),
      h("span", { class: "node-speed" },
        h("span", { class: "node-tps", title: "generated tokens passing through this node's layers" },
          formatRate(node.tokens_per_second),
          node.in_flight ? ` · serving ${plural(node.in_flight, "request")}` : ""),
        stepText(node))),
    h("div", { class: "node-row" },
      h("span", { class: "node-layers" }, layersText(stage, nLayers)),
      nLayers ? layerStrip(stage, nLayers) : null),
    h("div", { class: "node-row" },
      h("span", { class: "node-memory" }, memoryText(node.used_bytes, node.memory_bytes)),
      meter(node.used_bytes, node.memory_bytes)),
    kvRow(node),
    speedLine(node),
    weightsText(node),
    schedulerText(node),
    recoveryLine(node),
    // The cluster-wide problem is in the banner already; only say what is particular to this node.
    node.problem && node.problem !== picture.problem ? h("div", { class: "node-problem" }, node.problem) : null);
}

// Which node a ring's tokens spend their time on: its layers' median time per generated token, recently.
function stepText(node) {
  if (node.decode_step_ms == null) return null;
  return h("span", { class: "node-step", title: "median time this node's layers took per generated token over "
    + "its recent steps (sampling included on the last stage); the rest of a token's time is the hops between nodes" },
    `${formatMs(node.decode_step_ms)} per token`);
}

// Placement by speed: this node's measured time for one layer, its stage's share of each token's time around the
// ring, and whether it is the ring's bottleneck (the stage that sets the pace of the whole pipeline).
export function speedText(node) {
  const speed = node.speed;
  if (!speed) return null;
  if (speed.problem) return speed.problem;
  if (speed.decode_ms_per_layer == null) return "measuring its speed…";
  const parts = [`${formatLayerMs(speed.decode_ms_per_layer)} per layer`];
  if (node.share != null) parts.push(`${Math.round(100 * node.share)}% of each token`);
  if (node.bottleneck) parts.push("bottleneck");
  return parts.join(" · ");
}

function speedLine(node) {
  const text = speedText(node);
  if (!text) return null;
  const speed = node.speed;
  const measured = speed.measure_seconds == null ? "" : speed.cached
    ? ` (read from its cache; measuring took ${speed.measure_seconds.toFixed(2)} s)`
    : ` (measured in ${speed.measure_seconds.toFixed(2)} s)`;
  return h("div", { class: node.bottleneck ? "node-placement node-bottleneck" : "node-placement",
    title: "one decode step of one layer of this model on this node's engine, device and dtype" + measured
      + "; the share is this node's stage (its layers, the LM head on the last stage, the hop to the next node) "
      + "of the time a token takes around the ring" }, text);
}

// A member the plan gives no layers, and why (placement by speed leaves out a node that would only slow the ring).
export function leftOutText(entry) {
  return `${entry.name} holds no layers: ${entry.reason}.`;
}

// The KV cache: blocks of this node's pool that the ring's requests and its prefix cache hold.
function kvRow(node) {
  if (!node.kv_blocks) return null;
  const used = Math.min(node.kv_used, node.kv_blocks);
  return h("div", { class: "node-row" },
    h("span", { class: "node-kv", title: "KV cache blocks (16 positions each) held by running requests and the "
      + "prefix cache; requests wait in a queue when it is full" },
      `KV cache ${used} of ${node.kv_blocks} blocks`),
    meter(used, node.kv_blocks));
}

// A quantized model's matrices: the types running on quantized kernels, and any this node had to dequantize.
function weightsText(node) {
  const kept = Object.keys(node.quantized_weights || {});
  const dequantized = Object.entries(node.dequantized_weights || {});
  if (!kept.length && !dequantized.length) return null;
  const parts = kept.length ? [`quantized ${kept.join(", ")}`] : [];
  if (dequantized.length) {
    parts.push(`dequantized ${dequantized.map(([why, n]) => `${n} × ${why}`).join(", ")}`);
  }
  return h("div", { class: dequantized.length ? "node-weights node-dequantized" : "node-weights",
    title: "how this node holds the model's quantized matrices: on quantized kernels, or dequantized (more "
      + "memory) where its engine has no kernel for their type" }, parts.join(" · "));
}

// Requests of this node's clients whose ring broke under them: paused now, waiting for the re-formed ring to
// replay them on, and how many were resumed that way since the node started.
export function recoveryText(node) {
  const paused = Object.entries(node.recovering || {});
  const parts = paused.map(([lost, n]) => `${plural(n, "request")} recovering` +
    (lost ? `: lost ${lost}, replaying on the re-formed ring` : ": the ring re-formed, replaying"));
  if (node.replays) parts.push(`${plural(node.replays, "request")} resumed after a lost node or a re-plan`);
  return parts.length ? parts.join(" · ") : null;
}

function recoveryLine(node) {
  const text = recoveryText(node);
  if (!text) return null;
  const now = Object.keys(node.recovering || {}).length > 0;
  return h("div", { class: now ? "node-recovery node-recovering" : "node-recovery", title: "a request whose ring "
    + "loses a node (or re-plans) keeps its tokens, waits for the new ring and replays them there: the client's "
    + "stream pauses and goes on" }, text);
}

// The first stage batches the ring's requests and keeps the prefix cache.
function schedulerText(node) {
  if (!node.running && !node.waiting && !node.prefix_queries) return null;
  const parts = [`batching ${plural(node.running, "request")}`];
  if (node.waiting) parts.push(`${node.waiting} waiting`);
  if (node.prefix_queries) {
    const share = Math.round((100 * node.prefix_hits) / node.prefix_queries);
    parts.push(`prefix cache: ${share}% of prompt tokens reused`);
  }
  return h("div", { class: "node-scheduler", title: "this node is the ring's first stage: it schedules every "
    + "request's tokens into batches" }, parts.join(" · "));
}

// A layer's time: tens of microseconds on a small model, milliseconds on a large one; two significant digits.
function formatLayerMs(ms) {
  return ms >= 10 ? `${ms.toFixed(1)} ms` : `${ms.toPrecision(2)} ms`;
}

function formatMs(ms) {
  return ms >= 100 ? `${Math.round(ms)} ms` : `${ms.toFixed(1)} ms`;
}

function departedCard(node) {
  return h("li", { class: "node status-unreachable", "data-node-id": node.id, "data-status": "unreachable",
    style: `--node: ${colourOf(node.id)}` },
    cardHead(node, "unreachable", false),
    h("div", { class: "node-sub" }, h("span", { class: "node-device" }, deviceText(node))),
    h("div", { class: "node-gone" },
      `Lost ${ago(node.lost_seconds_ago)}; the ring was re-planned without it.`));
}

export function ago(seconds) {
  return seconds < 1 ? "just now" : `${Math.round(seconds)} s ago`;
}

function cardHead(node, status, me) {
  return h("div", { class: "node-head" },
    h("span", { class: "swatch", "aria-hidden": "true" }),
    h("span", { class: "node-name" }, node.name),
    me ? h("span", { class: "you", title: "the node serving this page" }, "you") : null,
    h("span", { class: `status-pill status-${status}` }, statusLabel(node, status)));
}

const ENGINES = { torch: "PyTorch", mlx: "MLX" };

function deviceText(node) {
  const device = node.device.replace(/^cpu\b/i, "CPU").replace(/^cuda/i, "CUDA").replace(/^mlx /i, "");
  return [ENGINES[node.engine] || node.engine, device, node.dtype, node.chip, node.address].filter(Boolean).join(" · ");
}

function layersText(stage, nLayers) {
  if (!stage) return nLayers ? "no layers" : "no model";
  const count = stage.end_layer - stage.start_layer;
  const which = count === 1 ? "layer" : "layers";
  return `${which} ${formatLayers(stage.start_layer, stage.end_layer)} · ${count} of ${nLayers}`;
}

// All the model's layers as cells, this node's range filled in its colour.
function layerStrip(stage, nLayers) {
  const cells = [];
  for (let layer = 0; layer < nLayers; layer += 1) {
    const mine = stage && layer >= stage.start_layer && layer < stage.end_layer;
    cells.push(h("span", { class: mine ? "cell mine" : "cell" }));
  }
  return h("span", { class: "strip", "aria-hidden": "true" }, cells);
}

function memoryText(used, total) {
  return used > total ? `needs ${formatBytes(used)}, has ${formatBytes(total)}`
    : `${formatBytes(used)} used of ${formatBytes(total)}`;
}

function meter(used, total) {
  const share = total > 0 ? Math.min(1, used / total) : 0;
  // A shard too small to see still gets a sliver, so "holds something" differs from "holds nothing".
  const width = used > 0 ? Math.max(share * 100, 2) : 0;
  return h("span", { class: used > total ? "meter over" : "meter", "aria-hidden": "true" },
    h("span", { style: `width: ${width}%` }));
}

// -- the bar of all layers --------------------------------------------------------------------------------

export function renderLayerBar(container, picture) {
  if (!picture.plan) {
    replace(container, h("p", { class: "muted empty" },
      picture.model ? "No plan yet." : "No model yet: layers are split once the cluster serves a model."));
    return;
  }
  const names = new Map(picture.nodes.map((node) => [node.id, node.name]));
  const n = picture.plan.n_layers;
  const segments = picture.plan.stages.map((stage) => {
    const count = stage.end_layer - stage.start_layer;
    const name = names.get(stage.node_id) || stage.node_id;
    return h("div", { class: "segment", style: `flex-grow: ${count}; --node: ${colourOf(stage.node_id)}`,
      title: `${name}: layers ${formatLayers(stage.start_layer, stage.end_layer)}` },
      h("span", { class: "segment-name" }, name),
      h("span", { class: "segment-range" }, formatLayers(stage.start_layer, stage.end_layer)));
  });
  replace(container,
    h("div", { class: "segments" }, segments),
    h("div", { class: "ticks" }, h("span", {}, "layer 0"), h("span", {}, `layer ${n - 1}`)));
}
