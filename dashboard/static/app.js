// The dashboard: follows this node's event stream (/v1/events) and draws the cluster on every picture.
// The stream reconnects by itself (EventSource retries each second; a watchdog replaces a stream that went
// silent), so the page survives its node restarting.

import { Chat } from "./chat.js";
import { Models } from "./models.js";
import { ago, leftOutText, recoveryText, renderLayerBar, renderNodeCards, renderRing } from "./topology.js";
import { assignColours, formatBytes, formatCount, formatRate, h, plural, replace, s } from "./util.js";

const STALE_AFTER_MS = 4000; // the server sends at least one picture per second
const HISTORY = 60; // throughput samples (one per second) in the sparkline

const $ = (id) => document.getElementById(id);

const state = { picture: null, lastEventAt: 0, connectedAt: 0, source: null, lostSince: null, history: [] };
const chat = new Chat($("chat"));
const models = new Models($("models"), { onLaunched: (name) => chat.prefer(name) });

// --api-key: the page asks for the key when the node answers 401, and keeps it in a SameSite=Strict cookie, which
// the browser sends with every request of this page, the event stream included (EventSource cannot set headers).
const KEY_COOKIE = "exo_like_api_key";

async function keyAccepted() {
  try {
    const response = await fetch("/v1/models", { method: "HEAD" }); // a guarded route every node serves
    return response.status !== 401;
  } catch (error) {
    return true; // unreachable: the stream shows the node as lost and retries
  }
}

function askForKey(message) {
  document.body.classList.add("needs-key");
  $("key-form").hidden = false;
  $("key-error").textContent = message;
  $("key-input").focus();
}

$("key-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const key = $("key-input").value.trim();
  document.cookie = `${KEY_COOKIE}=${encodeURIComponent(key)}; path=/; SameSite=Strict`;
  if (await keyAccepted()) {
    $("key-form").hidden = true;
    document.body.classList.remove("needs-key");
    connect();
  } else {
    askForKey("That key is not this node's.");
  }
});

async function start() {
  if (await keyAccepted()) connect();
  else askForKey("");
}

function connect() {
  if (state.source) state.source.close();
  const source = new EventSource("/v1/events");
  state.source = source;
  state.connectedAt = Date.now();
  source.addEventListener("cluster", (event) => {
    state.lastEventAt = Date.now();
    state.lostSince = null;
    render(JSON.parse(event.data));
  });
  source.addEventListener("error", () => {
    markLost();
    // A closed EventSource (e.g. the node answered with an error while restarting) never retries by itself.
    if (source.readyState === EventSource.CLOSED) setTimeout(reconnect, 1000);
  });
}

async function reconnect() {
  if (await keyAccepted()) connect();
  else askForKey("The node asks for a key again (restarted with another --api-key?).");
}

function markLost() {
  if (state.lostSince === null) state.lostSince = new Date();
  setConnection("lost");
  renderBanners();
}

// A stream can go silent without an error (a half-open connection): replace it.
function watchdog() {
  if (document.body.classList.contains("needs-key")) return; // nothing to watch until the key is given
  const now = Date.now();
  if (now - state.lastEventAt > STALE_AFTER_MS && now - state.connectedAt > STALE_AFTER_MS) {
    markLost();
    connect();
  }
}

function setConnection(mode) {
  const el = $("connection");
  el.dataset.state = mode;
  const me = state.picture && state.picture.nodes.find((node) => node.id === state.picture.node_id);
  const where = me ? `${me.name} · ${me.address}` : location.host;
  $("connection-text").textContent = mode === "live" ? `live from ${where}` :
    mode === "lost" ? `reconnecting to ${location.host}…` : "connecting…";
  document.body.classList.toggle("stale", mode === "lost");
}

function render(picture) {
  state.picture = picture;
  assignColours([...picture.nodes, ...picture.departed].map((node) => node.id));
  setConnection("live");
  renderBanners();
  renderSummary(picture);
  renderRing($("ring"), picture);
  renderNodeCards($("nodes"), picture);
  renderLayerBar($("layer-bar"), picture);
  $("ring-caption").textContent = ringCaption(picture);
  $("layers-caption").textContent = layersCaption(picture.plan);
  models.update(picture);
  chat.setCluster(picture);
}

// With several instances the ring and the layers are the oldest instance's (each node card lists them all): say
// whose.
function ringCaption(picture) {
  const count = picture.nodes.length;
  const stages = picture.plan ? picture.plan.stages : [];
  const whose = (picture.instances || []).length > 1 ? `${picture.model_name || picture.model}'s ring: ` : "";
  if (stages.some((stage) => stage.group)) {
    return whose + (stages.length === 1 ? `${plural(count, "node")} in one stage`
      : `${plural(count, "node")} in ${stages.length} stages, in pipeline order`);
  }
  return whose + (count === 1 ? "a ring of one" : `${count} nodes in pipeline order`);
}

// A tensor-parallel group runs one stage on several nodes.
function layersCaption(plan) {
  if (!plan) return "";
  const layers = plural(plan.n_layers, "layer");
  if (!plan.stages.some((stage) => stage.group)) return `${layers} over ${plural(plan.stages.length, "node")}`;
  const nodes = plan.stages.reduce((sum, stage) => sum + (stage.group ? stage.group.length : 1), 0);
  return `${layers} over ${plural(plan.stages.length, "stage")} on ${plural(nodes, "node")}`;
}

// -- banners: the explicit empty and failure states ------------------------------------------------------

function renderBanners() {
  const banners = [];
  const picture = state.picture;
  if (state.lostSince) {
    banners.push(banner("error", `Lost contact with this node at ${state.lostSince.toLocaleTimeString()}. ` +
      "Reconnecting by itself; what you see below may be out of date."));
  }
  if (picture) banners.push(...clusterBanners(picture));
  replace($("banners"), banners);
}

function clusterBanners(picture) {
  const banners = [];
  if (picture.problem) banners.push(banner("error", picture.problem, "The model cannot be served"));
  for (const node of picture.nodes) {
    if (node.problem && node.problem !== picture.problem) banners.push(banner("error", node.problem, node.name));
  }
  for (const node of picture.nodes) {
    const paused = Object.entries(node.recovering || {});
    if (paused.length) banners.push(banner("warn", `${node.name}: ${recoveryText({ recovering: node.recovering })}.`,
      "Recovering"));
  }
  for (const entry of picture.placement ? picture.placement.left_out : []) {
    banners.push(banner("info", leftOutText(entry), "Left out of the ring"));
  }
  for (const node of picture.departed) {
    banners.push(banner("warn", `${node.name} (${node.address}) left the cluster ${ago(node.lost_seconds_ago)}. ` +
      "The remaining nodes re-planned the layers.", "Node lost"));
  }
  if (!picture.model) {
    banners.push(banner("info", "Launch one from Models below, start a node with --model, or send a chat request " +
      "naming a model: the cluster loads the models it is asked for, several at once.", "No model yet"));
  } else if (!picture.ready && !picture.problem && picture.waiting_for) {
    banners.push(banner("info", `Waiting: ${picture.waiting_for}.`, "Forming the ring"));
  }
  for (const peer of picture.unlinked) {
    const who = peer.node_id ? `${peer.address} (node ${peer.node_id})` : peer.address;
    // Another cluster on the same LAN may be on purpose; everything else keeps nodes apart by mistake.
    banners.push(banner(peer.code === "other_cluster" ? "info" : "warn", `${who}: ${peer.reason}.`,
      "Not linked"));
  }
  if (picture.nodes.length === 1 && picture.departed.length === 0 && picture.unlinked.length === 0) {
    banners.push(banner("info", "This node is on its own. Run exo-like on another machine on the same " +
      "network and it joins by itself (or pass --peers host:port where multicast cannot reach).", "Alone"));
  }
  return banners;
}

function banner(kind, text, title = null) {
  return h("div", { class: `banner banner-${kind}`, role: kind === "error" ? "alert" : "status" },
    title ? h("strong", {}, `${title}: `) : null, text);
}

// -- summary tiles ----------------------------------------------------------------------------------------

function renderSummary(picture) {
  const usedBytes = picture.nodes.reduce((sum, node) => sum + node.used_bytes, 0);
  const plan = picture.plan;
  const others = (picture.instances || []).length - 1;
  replace($("summary"),
    tile("Model", picture.model_name || "none yet",
      plan ? [modelKind(picture), `${plural(plan.n_layers, "layer")} · ${formatBytes(picture.model_bytes)}`,
        others > 0 ? h("div", { class: "tile-others" }, `and ${plural(others, "more instance")}: see Models`) : null]
        : "no model chosen", "model"),
    tile("Memory", formatBytes(picture.total_memory_bytes),
      `layers take ${formatBytes(usedBytes)} · ${plural(picture.nodes.length, "node")}`, "memory"),
    tile("Ring", ringState(picture), [plan ? `digest ${plan.digest}` : "no plan yet",
      placementLine(picture.placement)], "agreement"),
    tile("Throughput", formatRate(picture.tokens_per_second), sparkline(), "throughput"),
    tile("Requests", `${picture.requests_in_flight} in flight`,
      picture.requests_in_flight ? "generating now" : "idle", "requests"),
    tile("Cluster key", picture.cluster_key === "set" ? "private" : "default",
      picture.cluster_key === "set" ? "only nodes with the key can join" : "any node on the network can join",
      "key"));
}

// The architecture and its parameters: a mixture of experts runs only some of them per token.
function modelKind(picture) {
  const params = picture.parameters;
  if (!picture.architecture || !params) return null;
  const active = params.active < params.total ? ` · ${formatCount(params.active)} active` : "";
  return h("div", { class: "tile-architecture", title: "the model's architecture, its parameters and, for a mixture "
    + "of experts, those one token runs through" },
    `${picture.architecture} · ${formatCount(params.total)} parameters${active}`);
}

const MODES = { compute: "pipeline by speed", memory: "pipeline by memory", tensor: "tensor parallel" };

// How the layers are split (a pipeline by measured speed or by memory, or with tensor-parallel groups) and why, and a
// token's time around the ring: predicted (for the pipeline and for tensor parallelism, when both were weighed)
// next to the measured one.
function placementLine(placement) {
  if (!placement) return null;
  return h("div", { class: "tile-placement", title: "how the layers were placed (--placement, --parallel), and a "
    + "token's time around the ring as the measured speeds predict it, and as the stages measure it (their recent "
    + "median steps added; the hops between nodes are not in it)" },
  h("div", { class: "placement-mode", "data-mode": placement.mode }, MODES[placement.mode] || placement.mode),
  h("div", { class: "placement-why" }, placement.why),
  placementTimes(placement));
}

function placementTimes(placement) {
  const parts = [];
  const predicted = placement.predicted_ms || {};
  const chosen = placement.mode === "tensor" ? "tensor" : "pipeline";
  if (predicted.pipeline != null && predicted.tensor != null) {
    parts.push(h("span", { class: "placement-predicted" }, "predicted per token: ",
      ["pipeline", "tensor"].flatMap((kind, i) => [i ? " · " : "",
        h("span", { class: kind === chosen ? "chosen" : null, "data-kind": kind },
          `${kind} ${formatMs(predicted[kind])}`)])));
  } else if (placement.time_per_token_ms != null) {
    parts.push(h("span", { class: "placement-predicted" },
      `predicted ${formatMs(placement.time_per_token_ms)} per token`));
  }
  if (placement.bottleneck_ms != null) parts.push(`slowest stage ${formatMs(placement.bottleneck_ms)}`);
  if (placement.measured_time_per_token_ms != null) {
    parts.push(h("span", { class: "placement-measured" },
      `measured ${formatMs(placement.measured_time_per_token_ms)} per token`));
  }
  if (!parts.length) return null;
  return h("div", { class: "placement-times" }, parts.flatMap((part, i) => [i ? " · " : "", part]));
}

// Tenths of a millisecond; two significant digits below one (a small model's stage takes a fraction of one).
function formatMs(ms) {
  return ms >= 1 ? `${ms.toFixed(1)} ms` : `${ms.toPrecision(2)} ms`;
}

function ringState(picture) {
  if (picture.problem || picture.nodes.some((node) => node.problem)) return "problem";
  if (picture.ready) return "agreed · ready";
  if (picture.agreed) return "agreed · loading";
  return picture.plan ? "agreeing…" : "no plan";
}

function tile(label, value, detail, key) {
  return h("div", { class: `tile tile-${key}`, "data-tile": key },
    h("div", { class: "tile-label" }, label),
    h("div", { class: "tile-value" }, value),
    h("div", { class: "tile-detail" }, detail));
}

function sampleThroughput() {
  if (!state.picture) return;
  state.history.push(state.lostSince ? 0 : state.picture.tokens_per_second);
  if (state.history.length > HISTORY) state.history.shift();
}

function sparkline() {
  const values = state.history.length ? state.history : [0];
  const peak = Math.max(...values, 1);
  const step = 100 / Math.max(HISTORY - 1, 1);
  const offset = HISTORY - values.length;
  const points = values.map((v, i) => `${((offset + i) * step).toFixed(1)},${(19 - (v / peak) * 17).toFixed(1)}`);
  return s("svg", { class: "spark", viewBox: "0 0 100 20", preserveAspectRatio: "none", "aria-hidden": "true" },
    s("line", { x1: 0, y1: 19.5, x2: 100, y2: 19.5, class: "base" }),
    s("polyline", { points: points.join(" ") }));
}

start();
setInterval(watchdog, 1000);
setInterval(sampleThroughput, 1000);
