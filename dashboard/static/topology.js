// The ring: an SVG of the plan's stages in pipeline order with arrows the way tokens flow, the node cards beside it,
// and the bar of all layers split between the stages. A stage is one node, or a tensor-parallel group: its members
// run a slice of every layer of the stage in lockstep, drawn together (one band on the ring, one box of cards, one
// segment of the bar); its leader (rank 0) is the stage's address on the ring.

import { colourOf, formatBytes, formatLayers, formatRate, h, instanceName, plural, replace, s } from "./util.js";

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

// The nodes running a stage, in rank order (a tensor-parallel group's leader first).
export function membersOf(stage) {
  return stage.group || [stage.node_id];
}

// The plan's stages in pipeline order, each with the member nodes that run it, then one slot for each member the
// plan does not use (yet).
export function stageSlots(picture) {
  const byId = new Map(picture.nodes.map((node) => [node.id, node]));
  const stages = picture.plan ? picture.plan.stages : [];
  const slots = stages.map((stage, index) => ({ stage, index,
    members: membersOf(stage).map((id) => byId.get(id)).filter(Boolean) })).filter((slot) => slot.members.length);
  const used = new Set(stages.flatMap(membersOf));
  const others = picture.nodes.filter((node) => !used.has(node.id))
    .map((node) => ({ stage: null, index: null, members: [node] }));
  return [...slots, ...others];
}

// Nodes in pipeline order (a group's members together, its leader first), then members the plan does not use yet.
export function ringOrder(picture) {
  return stageSlots(picture).flatMap((slot) => slot.members);
}

// The stage a node runs, alone or as a member of its group.
export function stageOf(picture, nodeId) {
  return picture.plan ? picture.plan.stages.find((stage) => membersOf(stage).includes(nodeId)) || null : null;
}

// A member's rank in its stage's tensor-parallel group, as "rank r/N" (null: it runs its stage alone).
export function rankText(stage, nodeId) {
  return stage && stage.group ? `rank ${stage.group.indexOf(nodeId)}/${stage.group.length}` : null;
}

export function groupText(stage) {
  return `tensor parallel · ${stage.group.length} ranks`;
}

// -- SVG ring ---------------------------------------------------------------------------------------------

const SIZE = 320;
const CENTRE = SIZE / 2;
const RADIUS = 108;
const NODE_RADIUS = 34;
const LABEL_DISTANCE = RADIUS + NODE_RADIUS + 12; // the "you" label sits outside the ring, clear of the arrows
const SIDE = 26; // room beside the square for a label next to a node on the left or right
// A tensor-parallel group's band: its members' smaller discs in rows (up to three a row) under a caption line, with
// room under each disc for "you" in the band of the node serving the page.
const MEMBER_RADIUS = 28;
const MEMBER_GAP = 6;
const BAND_PAD = 7;
const BAND_CAPTION = 16;
const YOU_ROW = 13;
const CENTRE_TEXT = [62, 22]; // half the width and height of the rate and caption in the ring's centre

export function renderRing(container, picture) {
  const slots = stageSlots(picture);
  const flowing = picture.requests_in_flight > 0;
  const places = slots.map((slot, i) => placeOf(slot, slots.length === 1 ? null : angleAt(i, slots.length),
    picture.node_id));
  const svg = s("svg", { viewBox: viewBox(places), role: "img", "aria-label": ringLabel(slots) },
    s("defs", {}, s("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 7, refY: 5, markerWidth: 6,
      markerHeight: 6, orient: "auto-start-reverse" }, s("path", { d: "M0,0 L10,5 L0,10 z", class: "arrow-head" }))),
    places.length === 1 ? loopArrow(places[0], flowing) : places.map((place, i) =>
      arcArrow(place, places[(i + 1) % places.length], flowing)),
    centreText(picture, places.length),
    places.map((place) => place.band ? groupBand(place, picture)
      : nodeBubble(place.slot.members[0], picture, place.x, place.y, place.angle)));
  replace(container, svg);
}

// Where a slot is drawn: its centre (on the ring, or the centre for a ring of one) and the half extents of what is
// drawn there (a node's bubble, or a group's band). A band that would cover the centre's text moves out from the
// ring as far as it must (the arrows still run along the ring, into its inner side).
function placeOf(slot, angle, me) {
  const [x, y] = angle === null ? [CENTRE, CENTRE] : pointAt(angle);
  if (!slot.stage || !slot.stage.group) {
    return { slot, angle, x, y, band: false, halfW: NODE_RADIUS, halfH: NODE_RADIUS };
  }
  const count = slot.members.length;
  const cols = count <= 3 ? count : Math.ceil(count / 2);
  const rows = Math.ceil(count / cols);
  const rowHeight = 2 * MEMBER_RADIUS + (slot.members.some((node) => node.id === me) ? YOU_ROW : 0);
  const halfW = (cols * 2 * MEMBER_RADIUS + (cols - 1) * MEMBER_GAP + 2 * BAND_PAD) / 2;
  const halfH = (BAND_CAPTION + rows * rowHeight + (rows - 1) * MEMBER_GAP + BAND_PAD) / 2;
  const [cx, cy] = angle === null ? [x, y] : pointAt(angle, RADIUS + bandShift(angle, halfW, halfH));
  return { slot, angle, x: cx, y: cy, band: true, cols, rowHeight, halfW, halfH };
}

// How much further out than the ring a band's centre must sit to keep clear of the centre's text (at most its
// half height: the ring still runs through the band).
function bandShift(angle, halfW, halfH) {
  const [cos, sin] = [Math.abs(Math.cos(angle)), Math.abs(Math.sin(angle))];
  const across = cos > 0.01 ? (CENTRE_TEXT[0] + 6 + halfW) / cos : Infinity;
  const along = sin > 0.01 ? (CENTRE_TEXT[1] + 6 + halfH) / sin : Infinity;
  return Math.min(Math.max(0, Math.min(across, along) - RADIUS), halfH);
}

// Crop what the drawing leaves empty (a ring of three has nothing below its lowest arc); widen it for a group's band.
function viewBox(places) {
  if (places.length === 1) {
    const [rx, ry] = loopRadii(places[0]);
    const reach = ry + 8; // the loop arrow around the single bubble or band
    const halfWidth = Math.max(CENTRE, rx + 8);
    return `${CENTRE - halfWidth} ${CENTRE - reach} ${2 * halfWidth} ${2 * reach}`;
  }
  const xs = [-SIDE, SIZE + SIDE];
  const margin = places.some((place) => place.band) ? 10 : 4; // an arrow's head may end at the ring's lowest point
  const ys = [CENTRE - RADIUS - margin, CENTRE + RADIUS + margin];
  for (const place of places) {
    xs.push(place.x - place.halfW - 4, place.x + place.halfW + 4);
    ys.push(place.y - place.halfH - 4, place.y + place.halfH + 4);
    if (!place.band) {
      const labelY = pointAt(place.angle, LABEL_DISTANCE)[1];
      ys.push(labelY - 8, labelY + 8);
    }
  }
  const [left, top] = [Math.floor(Math.min(...xs)), Math.floor(Math.min(...ys))];
  return `${left} ${top} ${Math.ceil(Math.max(...xs)) - left} ${Math.ceil(Math.max(...ys)) - top}`;
}

function ringLabel(slots) {
  const grouped = slots.some((slot) => slot.stage && slot.stage.group);
  const names = slots.map((slot) => slot.members.map((node) => node.name).join(" + ")
    + (slot.stage && slot.stage.group ? ` (${groupText(slot.stage)})` : ""));
  return `Ring of ${plural(slots.length, grouped ? "stage" : "node")}: ${names.join(" → ")}`;
}

function angleAt(index, count) {
  return -Math.PI / 2 + (2 * Math.PI * index) / count;
}

function pointAt(angle, radius = RADIUS) {
  return [CENTRE + radius * Math.cos(angle), CENTRE + radius * Math.sin(angle)];
}

// An arc along the ring from one stage to the next, stopping short of both (a bubble or a band).
function arcArrow(fromPlace, toPlace, flowing) {
  const from = fromPlace.angle + clearance(fromPlace, 1);
  const to = toPlace.angle <= fromPlace.angle ? toPlace.angle + 2 * Math.PI : toPlace.angle;
  const end = to - clearance(toPlace, -1);
  if (end - from < 0.05) return null; // two bands side by side: no room for an arrow between them
  const [x1, y1] = pointAt(from);
  const [x2, y2] = pointAt(end);
  const large = end - from > Math.PI ? 1 : 0;
  const d = `M${x1.toFixed(1)},${y1.toFixed(1)} A${RADIUS},${RADIUS} 0 ${large} 1 ${x2.toFixed(1)},${y2.toFixed(1)}`;
  return s("path", { d, class: flowing ? "link flowing" : "link", "marker-end": "url(#arrow)" });
}

// How far along the ring (radians, in `direction`) the arrow keeps clear of what is drawn at a place.
function clearance(place, direction) {
  if (!place.band) return (NODE_RADIUS + 8) / RADIUS;
  for (let t = 0; t < Math.PI; t += 0.01) {
    const [x, y] = pointAt(place.angle + direction * t);
    if (Math.abs(x - place.x) > place.halfW + 8 || Math.abs(y - place.y) > place.halfH + 8) return t;
  }
  return Math.PI;
}

// The loop arrow's radii around a ring of one: a circle around a bubble, an ellipse around a band (clear of its
// corners: they are on the ellipse of radii √2 times its half extents).
function loopRadii(place) {
  return place.band ? [place.halfW * Math.SQRT2 + 12, place.halfH * Math.SQRT2 + 12]
    : [NODE_RADIUS + 22, NODE_RADIUS + 22];
}

// A ring of one: the node (or the group) feeds itself.
function loopArrow(place, flowing) {
  const [rx, ry] = loopRadii(place);
  const [x1, y1] = [CENTRE + rx * Math.cos(-1.2), CENTRE + ry * Math.sin(-1.2)];
  const [x2, y2] = [CENTRE + rx * Math.cos(-1.9), CENTRE + ry * Math.sin(-1.9)];
  const d = `M${x1.toFixed(1)},${y1.toFixed(1)} A${rx},${ry} 0 1 1 ${x2.toFixed(1)},${y2.toFixed(1)}`;
  return s("path", { d, class: flowing ? "link flowing" : "link", "marker-end": "url(#arrow)" });
}

function centreText(picture, count) {
  if (count === 1) return null; // the single bubble sits in the centre
  return s("g", { class: "centre" },
    s("text", { x: CENTRE, y: CENTRE - 4, class: "centre-big" }, formatRate(picture.tokens_per_second)),
    s("text", { x: CENTRE, y: CENTRE + 16, class: "centre-small" }, "tokens flow clockwise"));
}

function nodeBubble(node, picture, x, y, angle) {
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

// A tensor-parallel group: one band at the stage's place on the ring, its caption the group's size and the layers
// its members share, and each member's disc with its name and rank.
function groupBand(place, picture) {
  const { slot, x, y, halfW, halfH, cols, rowHeight } = place;
  const stage = slot.stage;
  const layers = formatLayers(stage.start_layer, stage.end_layer);
  const names = slot.members.map((node) => node.name).join(", ");
  const top = y - halfH;
  const members = slot.members.map((node, i) => {
    const row = Math.floor(i / cols);
    const inRow = Math.min(cols, slot.members.length - row * cols);
    const mx = x + (i % cols - (inRow - 1) / 2) * (2 * MEMBER_RADIUS + MEMBER_GAP);
    const my = top + BAND_CAPTION + MEMBER_RADIUS + row * (rowHeight + MEMBER_GAP);
    return memberBubble(node, picture, stage, mx, my);
  });
  return s("g", { class: "tp-group", "data-stage": slot.index, "data-leader": stage.node_id },
    s("rect", { x: x - halfW, y: top, width: 2 * halfW, height: 2 * halfH, rx: 12, class: "tp-band" }),
    s("text", { x, y: top + 12, class: "tp-caption" }, `TP × ${stage.group.length} · L ${layers}`),
    members,
    s("title", {}, `${groupText(stage)}: ${names} run layers ${layers} together, each a slice of every layer`));
}

function memberBubble(node, picture, stage, x, y) {
  const me = node.id === picture.node_id;
  const status = displayStatus(node);
  return s("g", { class: `bubble member status-${status}${me ? " me" : ""}`, "data-node-id": node.id,
    style: `--node: ${colourOf(node.id)}` },
    me ? s("circle", { cx: x, cy: y, r: MEMBER_RADIUS + 4, class: "halo" }) : null,
    s("circle", { cx: x, cy: y, r: MEMBER_RADIUS, class: "disc" }),
    s("text", { x, y: y - 1, class: "member-name" }, shorten(node.name, 8)),
    s("text", { x, y: y + 12, class: "member-rank" }, rankText(stage, node.id)),
    me ? s("text", { x, y: y + MEMBER_RADIUS + 12, class: "bubble-you" }, "you") : null,
    s("title", {}, `${node.name} (${node.address}): ${rankText(stage, node.id)}`));
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
  const cards = stageSlots(picture).map((slot) => slot.stage && slot.stage.group ? groupBox(slot, picture)
    : nodeCard(slot.members[0], picture));
  const gone = picture.departed.map((node) => departedCard(node));
  replace(list, cards, gone);
}

// A tensor-parallel group's cards in one box, headed by what they share: the group's size, its layers, and its
// stage's time per token, predicted and measured (the leader's step is the group's).
function groupBox(slot, picture) {
  const stage = slot.stage;
  const leader = slot.members.find((node) => node.id === stage.node_id);
  const nLayers = picture.plan.n_layers;
  return h("li", { class: "stage-group", "data-stage": slot.index, "data-leader": stage.node_id,
    "data-size": stage.group.length, style: `--node: ${colourOf(stage.node_id)}` },
    h("div", { class: "group-head" },
      h("span", { class: "group-kind" }, groupText(stage)),
      h("span", { class: "group-layers" }, layersText(stage, nLayers))),
    leader ? groupTimes(leader) : null,
    h("ol", { class: "group-members", "aria-label": `members of the ${groupText(stage)} group, in rank order` },
      slot.members.map((node) => nodeCard(node, picture))));
}

// The stage's time per token as placement predicted it and as its leader measured it, and its share of a token.
export function groupTimesText(leader) {
  const times = [];
  if (leader.stage_ms != null) times.push(`predicted ${formatMs(leader.stage_ms)}`);
  if (leader.decode_step_ms != null) times.push(`measured ${formatMs(leader.decode_step_ms)}`);
  const parts = times.length ? [`${times.join(" · ")} per token`] : [];
  if (leader.share != null) parts.push(`${Math.round(100 * leader.share)}% of each token`);
  if (leader.bottleneck) parts.push("bottleneck");
  return parts.length ? parts.join(" · ") : null;
}

function groupTimes(leader) {
  const text = groupTimesText(leader);
  if (!text) return null;
  return h("div", { class: leader.bottleneck ? "group-times node-bottleneck" : "group-times",
    title: "the group's stage: its time per generated token as placement predicted it (the slowest rank's slice "
      + "of each layer, two all-reduces a layer, the hop to the next stage) and its leader's recent median step" },
  text);
}

function nodeCard(node, picture) {
  const stage = stageOf(picture, node.id);
  const status = displayStatus(node);
  const nLayers = picture.plan ? picture.plan.n_layers : 0;
  const rank = rankText(stage, node.id);
  return h("li", { class: `node status-${status}`, "data-node-id": node.id, "data-status": status,
    "data-start": stage ? stage.start_layer : null, "data-end": stage ? stage.end_layer : null,
    "data-rank": rank ? stage.group.indexOf(node.id) : null, style: `--node: ${colourOf(node.id)}` },
    cardHead(node, status, node.id === picture.node_id, rank && rankTag(stage, node.id)),
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
    instancesRow(node, picture),
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

// The instances this node runs layers of, as the picture's instances say (the layers above are the oldest
// instance's): one badge each, with its model and layers, its state in its colour.
export function heldInstances(picture, nodeId) {
  return (picture.instances || []).filter((instance) => instance.nodes && instance.nodes[nodeId]
    && instance.nodes[nodeId].stage != null).map((instance) => ({ instance, part: instance.nodes[nodeId] }));
}

function instancesRow(node, picture) {
  const held = heldInstances(picture, node.id);
  if (!held.length) return null;
  return h("div", { class: "node-instances", "aria-label": "instances on this node" },
    held.map(({ instance, part }) => instanceBadge(instance, part)));
}

function instanceBadge(instance, part) {
  const layers = formatLayers(part.start_layer, part.end_layer);
  return h("span", { class: `instance-badge status-${part.status}`, "data-instance-id": instance.id,
    "data-status": part.status, title: `${instance.model}: layers ${layers} here, `
      + (STATUS_LABELS[part.status] || part.status) },
  h("span", { class: "badge-name" }, instanceName(instance)),
  h("span", { class: "badge-layers" }, `L ${layers}`));
}

// Which node a ring's tokens spend their time on: its layers' median time per generated token, recently.
function stepText(node) {
  if (node.decode_step_ms == null) return null;
  return h("span", { class: "node-step", title: "median time this node's layers took per generated token over "
    + "its recent steps (sampling included on the last stage); the rest of a token's time is the hops between nodes" },
    `${formatMs(node.decode_step_ms)} per token`);
}

// Placement by speed: this node's measured time for one layer, its stage's share of each token's time around the
// ring, and whether it is the ring's bottleneck (the stage that sets the pace of the whole pipeline). A follower in
// a tensor-parallel group has no stage of its own: its rank instead of a share (its leader's card has the group's).
export function speedText(node) {
  const speed = node.speed;
  if (!speed) return null;
  if (speed.problem) return speed.problem;
  if (speed.decode_ms_per_layer == null) return "measuring its speed…";
  const parts = [`${formatLayerMs(speed.decode_ms_per_layer)} per layer`];
  if (node.tp && node.tp.rank > 0) parts.push(`rank ${node.tp.rank}/${node.tp.size}: a slice of each layer`);
  else if (node.share != null) parts.push(`${Math.round(100 * node.share)}% of each token`);
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
  if (!node.running && !node.waiting && !node.prefix_queries && !node.draft_tokens) return null;
  const parts = [`batching ${plural(node.running, "request")}`];
  if (node.waiting) parts.push(`${node.waiting} waiting`);
  if (node.prefix_queries) {
    const share = Math.round((100 * node.prefix_hits) / node.prefix_queries);
    parts.push(`prefix cache: ${share}% of prompt tokens reused`);
  }
  if (node.draft_tokens) {
    const kept = Math.round((100 * node.accepted_tokens) / node.draft_tokens);
    const perPass = node.drafts ? ` (${(1 + node.accepted_tokens / node.drafts).toFixed(1)} tokens a pass)` : "";
    parts.push(`speculation: ${kept}% of ${node.draft_tokens} proposed tokens kept${perPass}`);
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

function cardHead(node, status, me, tag = null) {
  return h("div", { class: "node-head" },
    h("span", { class: "swatch", "aria-hidden": "true" }),
    h("span", { class: "node-name" }, node.name),
    me ? h("span", { class: "you", title: "the node serving this page" }, "you") : null,
    tag,
    h("span", { class: `status-pill status-${status}` }, statusLabel(node, status)));
}

function rankTag(stage, nodeId) {
  const leader = stage.node_id === nodeId;
  return h("span", { class: "node-rank", title: leader ? "the group's leader: the stage's address on the ring; it "
    + "runs rank 0's slice of every layer and hands each step to the other ranks"
    : "a follower: it runs its slice of every layer of the stage in lockstep with the leader" },
  `${rankText(stage, nodeId)}${leader ? " · leader" : ""}`);
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
  const segments = picture.plan.stages.map((stage, index) => {
    const count = stage.end_layer - stage.start_layer;
    const members = membersOf(stage);
    const name = members.map((id) => names.get(id) || id).join(" + ");
    const range = formatLayers(stage.start_layer, stage.end_layer);
    return h("div", { class: stage.group ? "segment segment-group" : "segment", "data-stage": index,
      style: `flex-grow: ${count}; --node: ${colourOf(stage.node_id)}`,
      title: stage.group ? `${groupText(stage)}: ${name} run layers ${range}, each a slice of every layer`
        : `${name}: layers ${range}` },
      stage.group ? h("span", { class: "segment-swatches", "aria-hidden": "true" },
        members.map((id) => h("span", { class: "swatch", style: `--node: ${colourOf(id)}` }))) : null,
      h("span", { class: "segment-name" }, name),
      h("span", { class: "segment-range" }, range),
      stage.group ? h("span", { class: "segment-tp" }, `TP × ${stage.group.length}`) : null);
  });
  replace(container,
    h("div", { class: "segments" }, segments),
    h("div", { class: "ticks" }, h("span", {}, "layer 0"), h("span", {}, `layer ${n - 1}`)));
}
