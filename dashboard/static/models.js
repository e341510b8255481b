// The Models panel: launch a model and follow the cluster's instances of it. The picker lists what GET /v1/models
// says this node can serve (loaded, on its disk or in its cache, the catalog), each with its state; the text field
// takes any name. Launch asks POST /v1/instances, on the ticked nodes (none ticked: where placement puts it). Each
// instance of the picture is listed with its load (per node, a download's progress), its requests, its keep-alive
// and an Unload button (DELETE /v1/instances/{id}).
//
// Instances come with the event stream's pictures (no polling of their own). The models are read again when the
// instances change, after a launch or an unload, and when the picker is opened: a download changes the list.
// The launch controls and each row's Unload button are kept across pictures (one a second), only the text around them
// redrawn: a button replaced between the press and the release of a click would lose the click.

import { colourOf, errorText, formatBytes, formatCount, formatCountdown, formatLayers, h, instanceName, plural,
  replace } from "./util.js";

const MODEL_STATES = { serving: "serving", loading: "loading", local: "on disk", downloaded: "downloaded",
  partial: "partly downloaded", not_downloaded: "not downloaded" };
// The picker's groups, in this order; a state not named here (a newer node's) goes to the last.
const GROUPS = [
  ["Loaded", ["serving", "loading"]],
  ["On this node", ["local", "downloaded", "partial"]],
  ["Catalog: downloaded when launched", ["not_downloaded"]],
];
const INSTANCE_STATES = { ready: "ready", busy: "busy", loading: "loading", problem: "can't serve" };
const NODE_STATES = { ready: "ready", loading: "loading layers", joining: "joining" };
const UNLOAD_PATIENCE_MS = 15000; // an instance still listed this long after its unload was accepted: let it be retried

export class Models {
  constructor(root, { onLaunched }) {
    this.onLaunched = onLaunched; // called with the launched model's name (the chat then picks it)
    this.form = root.querySelector("#launch-form");
    this.pick = root.querySelector("#launch-pick");
    this.nameField = root.querySelector("#launch-model");
    this.nodeBoxes = root.querySelector("#launch-nodes");
    this.launchButton = root.querySelector("#launch");
    this.status = root.querySelector("#launch-status");
    this.list = root.querySelector("#instances");
    this.caption = root.querySelector("#models-caption");
    this.names = document.getElementById("model-names"); // the datalist every model text field suggests from
    this.rows = new Map(); // instance id -> its row (kept across pictures)
    this.empty = h("li", { class: "instances-empty muted" }, "Nothing loaded. Pick a model and launch it, or chat "
      + "naming one: the cluster loads it on demand.");
    this.unloading = new Map(); // instance id -> when its unload was asked for
    this.unloadErrors = new Map(); // instance id -> the server's answer to a failed unload
    this.members = ""; // the node boxes' members, as last drawn
    this.served = null; // the instances' ids and states, as last seen: a change reads the models again
    this.modelsShown = ""; // the picker's entries, as last drawn
    this.modelsRead = 0; // reads of /v1/models started: an answer overtaken by a later read is dropped
    this.bind();
  }

  bind() {
    this.form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.launch();
    });
    this.pick.addEventListener("change", () => {
      if (this.pick.value) this.nameField.value = this.pick.value;
    });
    // Typing another name: the picker no longer names what will be launched.
    this.nameField.addEventListener("input", () => {
      if (this.pick.value !== this.nameField.value.trim()) this.pick.value = "";
    });
    this.pick.addEventListener("focus", () => this.readModels());
  }

  // Called with every cluster picture.
  update(picture) {
    const instances = picture.instances || [];
    this.showNodeBoxes(picture);
    this.showInstances(instances, picture);
    const served = instances.map((instance) => `${instance.id} ${instance.ready}`).join("\n");
    if (served !== this.served) {
      this.served = served;
      this.readModels();
    }
  }

  // -- the picker ---------------------------------------------------------------------------------------------

  async readModels() {
    const read = ++this.modelsRead;
    let entries;
    try {
      const response = await fetch("/v1/models");
      if (!response.ok) return; // the event stream shows what is wrong with the node
      entries = (await response.json()).data;
    } catch (error) {
      return; // unreachable: the event stream shows the node as lost; keep the list shown
    }
    if (read === this.modelsRead) this.showModels(entries);
  }

  showModels(entries) {
    const shown = entries.map((entry) => `${entry.id} ${entry.state}`).join("\n");
    if (shown === this.modelsShown) return;
    this.modelsShown = shown;
    const chosen = this.pick.value;
    const groups = GROUPS.map(([label, states]) => [label, entries.filter((entry) => states.includes(entry.state))]);
    const known = GROUPS.flatMap(([, states]) => states);
    groups.push(["Other", entries.filter((entry) => !known.includes(entry.state))]);
    replace(this.pick, h("option", { value: "" }, entries.length ? "Pick a model…" : "No models listed: type a name"),
      groups.filter(([, members]) => members.length).map(([label, members]) => h("optgroup", { label },
        members.map((entry) => h("option", { value: entry.id, "data-state": entry.state }, modelText(entry))))));
    this.pick.value = entries.some((entry) => entry.id === chosen) ? chosen : "";
    replace(this.names, entries.map((entry) => h("option", { value: entry.id }, MODEL_STATES[entry.state]
      || entry.state)));
  }

  // Ticks for the members, to launch on chosen nodes; redrawn only when the members change, ticks kept.
  showNodeBoxes(picture) {
    const members = picture.nodes.map((node) => `${node.id} ${node.name}`).join("\n");
    if (members === this.members) return;
    this.members = members;
    const ticked = new Set([...this.nodeBoxes.querySelectorAll("input:checked")].map((box) => box.value));
    replace(this.nodeBoxes, picture.nodes.map((node) => h("label", { class: "check node-box",
      style: `--node: ${colourOf(node.id)}` },
    h("input", { type: "checkbox", value: node.id, checked: ticked.has(node.id) }),
    h("span", { class: "swatch", "aria-hidden": "true" }),
    node.id === picture.node_id ? `${node.name} (you)` : node.name)));
  }

  // -- launch -------------------------------------------------------------------------------------------------

  async launch() {
    const name = this.nameField.value.trim();
    if (this.launchButton.disabled) return; // one launch at a time: its answer says how it went
    if (!name) {
      this.setStatus("error", "Pick a model, or type its name, first.");
      this.nameField.focus();
      return;
    }
    const boxes = [...this.nodeBoxes.querySelectorAll("input:checked")];
    const nodes = boxes.map((box) => box.value);
    const where = boxes.length ? ` on ${boxes.map((box) => box.parentElement.textContent).join(", ")}` : "";
    this.setStatus("pending", `Asking the cluster to load ${name}${where}…`);
    this.launchButton.disabled = true;
    try {
      const response = await fetch("/v1/instances", { method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify(nodes.length ? { model: name, nodes } : { model: name }) });
      if (!response.ok) {
        this.setStatus("error", `Could not launch ${name}: ${await errorText(response)}`);
        return;
      }
      const launched = await response.json();
      this.setStatus("ok", `Launched ${launched.model}${where}: its instance below shows its load.`);
      this.onLaunched(launched.model);
      this.readModels();
    } catch (error) {
      this.setStatus("error", `Could not reach this node (${error.message}). Is it still running?`);
    } finally {
      this.launchButton.disabled = false;
    }
  }

  setStatus(state, text) {
    this.status.dataset.state = state;
    this.status.textContent = text;
  }

  // -- instances ----------------------------------------------------------------------------------------------

  showInstances(instances, picture) {
    const members = new Map(picture.nodes.map((node) => [node.id, node]));
    const now = Date.now();
    for (const [id, since] of this.unloading) {
      if (!instances.some((instance) => instance.id === id) || now - since > UNLOAD_PATIENCE_MS) {
        this.unloading.delete(id);
      }
    }
    const rows = instances.map((instance) => {
      const row = this.rows.get(instance.id) || this.newRow(instance.id);
      this.rows.set(instance.id, row);
      this.fillRow(row, instance, members, instances.filter((other) => other.model === instance.model).length);
      return row.li;
    });
    for (const id of [...this.rows.keys()]) {
      if (!instances.some((instance) => instance.id === id)) {
        this.rows.delete(id);
        this.unloadErrors.delete(id);
      }
    }
    this.caption.textContent = instances.length ? `${plural(instances.length, "instance")} on the cluster` : "";
    const order = rows.length ? rows : [this.empty];
    // Moved only when the order changes: moving a row would take the focus off its button.
    const current = [...this.list.children];
    if (current.length !== order.length || current.some((li, i) => li !== order[i])) replace(this.list, order);
  }

  newRow(id) {
    const button = h("button", { type: "button", class: "unload", "data-instance-id": id }, "Unload");
    button.addEventListener("click", () => this.unload(id, button));
    const main = h("div", { class: "instance-main" });
    const li = h("li", { class: "instance", "data-instance-id": id }, main, button);
    return { li, main, button };
  }

  // `copies`: the instances of its model. The first one's id is the model's key, and DELETE by the model's key
  // unloads every instance of the model: its button says so.
  fillRow(row, instance, members, copies) {
    const status = instanceStatus(instance);
    row.li.dataset.status = status;
    row.li.dataset.ready = instance.ready ? "true" : "false";
    const all = instance.id === instance.model && copies > 1;
    row.button.dataset.label = all ? `Unload all ${copies}` : "Unload";
    row.button.title = `stop serving ${all ? "every instance of this model" : "it"} on every node; the requests `
      + "running there end with an error";
    const unloading = this.unloading.has(instance.id);
    row.button.disabled = unloading;
    row.button.textContent = unloading ? "Unloading…" : row.button.dataset.label;
    const error = this.unloadErrors.get(instance.id);
    replace(row.main,
      h("div", { class: "instance-head" },
        h("span", { class: "instance-name", title: instance.model }, instanceName(instance)),
        h("span", { class: `status-pill status-${status}` }, INSTANCE_STATES[status])),
      kindText(instance) ? h("div", { class: "instance-kind muted" }, kindText(instance)) : null,
      h("div", { class: "instance-use" }, useText(instance)),
      !instance.ready && !instance.problem && instance.waiting_for
        ? h("div", { class: "instance-waiting" }, `Waiting: ${instance.waiting_for}.`) : null,
      instance.problem ? h("div", { class: "instance-problem" }, instance.problem) : null,
      nodeList(instance, members),
      error ? h("div", { class: "instance-problem instance-error", role: "alert" }, error) : null);
  }

  async unload(id, button) {
    if (button.disabled) return;
    this.unloadErrors.delete(id);
    this.unloading.set(id, Date.now()); // the button stays disabled through the pictures until the picture drops it
    button.disabled = true;
    button.textContent = "Unloading…";
    try {
      const response = await fetch(`/v1/instances/${encodeURIComponent(id)}`, { method: "DELETE" });
      if (response.ok) {
        this.readModels();
        return;
      }
      this.unloadErrors.set(id, `Could not unload it: ${await errorText(response)}`);
    } catch (error) {
      this.unloadErrors.set(id, `Could not reach this node (${error.message}). Is it still running?`);
    }
    this.unloading.delete(id);
    button.disabled = false;
    button.textContent = button.dataset.label;
    const row = this.rows.get(id);
    if (row) row.main.append(h("div", { class: "instance-problem instance-error", role: "alert" },
      this.unloadErrors.get(id)));
  }
}

// A /v1/models entry in the picker: its name, its state, and its size where the listing has it.
export function modelText(entry) {
  const parts = [entry.id, MODEL_STATES[entry.state] || entry.state];
  const parameters = typeof entry.parameters === "number" ? entry.parameters
    : entry.parameters ? entry.parameters.total : null;
  if (parameters) parts.push(`${formatCount(parameters)} parameters`);
  const bytes = entry.bytes ?? entry.size_bytes;
  if (bytes) parts.push(formatBytes(bytes));
  return parts.join(" · ");
}

export function instanceStatus(instance) {
  if (instance.problem) return "problem";
  if (!instance.ready) return "loading";
  return instance.in_flight ? "busy" : "ready";
}

// Its requests now, and how long it stays loaded without them (keep_alive; null: until it is unloaded).
export function useText(instance) {
  const requests = instance.in_flight ? `${plural(instance.in_flight, "request")} in flight` : "idle";
  const kept = instance.expires_in_seconds == null ? "kept until unloaded"
    : `unloads in ${formatCountdown(instance.expires_in_seconds)} if idle`;
  return `${requests} · ${kept}`;
}

function kindText(instance) {
  const parts = [];
  if (instance.architecture) parts.push(instance.architecture);
  if (instance.parameters) parts.push(`${formatCount(instance.parameters.total)} parameters`);
  if (instance.model_bytes) parts.push(formatBytes(instance.model_bytes));
  if (instance.plan) parts.push(plural(instance.plan.n_layers, "layer"));
  return parts.join(" · ");
}

// What each node of its plan is doing for it, in pipeline order: its layers and its state, with the download's
// progress while it fetches its layers' files.
export function nodeStates(instance, members) {
  const parts = Object.entries(instance.nodes || {}).filter(([, part]) => part.stage != null); // in its plan
  parts.sort(([, a], [, b]) => a.stage - b.stage || (a.tp ? a.tp.rank : 0) - (b.tp ? b.tp.rank : 0));
  return parts.map(([id, part]) => {
    const node = members.get(id);
    const download = node && part.status !== "ready" ? node.download : null;
    const downloading = download && download.state === "downloading";
    let text = NODE_STATES[part.status] || part.status;
    if (downloading) {
      text = `downloading ${Math.floor(download.percent)} % (${formatBytes(download.done_bytes)} of `
        + `${formatBytes(download.total_bytes)})`;
    } else if (download && download.state === "failed") {
      text = `download failed${download.error ? `: ${download.error}` : ""}`;
    }
    const layers = `${part.end_layer - part.start_layer === 1 ? "layer" : "layers"} `
      + formatLayers(part.start_layer, part.end_layer);
    return { id, name: node ? node.name : id, layers,
      status: part.status, text, percent: downloading ? download.percent : null,
      label: download ? download.label : null };
  });
}

function nodeList(instance, members) {
  const states = nodeStates(instance, members);
  if (!states.length) return null;
  return h("ol", { class: "instance-nodes", "aria-label": "its nodes, in pipeline order" },
    states.map((state) => h("li", { class: `instance-node status-${state.status}`, "data-node-id": state.id,
      style: `--node: ${colourOf(state.id)}`, title: state.label },
    h("span", { class: "swatch", "aria-hidden": "true" }),
    h("span", { class: "instance-node-name" }, state.name),
    h("span", { class: "muted" }, state.layers),
    h("span", { class: "instance-node-state" }, state.text),
    state.percent === null ? null : h("span", { class: "meter", "aria-hidden": "true" },
      h("span", { style: `width: ${Math.max(state.percent, 2)}%` })))));
}
