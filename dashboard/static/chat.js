// The chat panel: streams from this node's own /v1/chat/completions, so every answer crosses the whole ring.
// Stop aborts the fetch; the node sees the client go away and frees the request on every stage.

import { formatRate, formatSeconds, h, plural, replace } from "./util.js";

const SETTINGS_KEY = "exo-like.chat.settings";

// An error the node reported (in the HTTP status, or in-band once the stream had started): its own words.
class ApiError extends Error {
  constructor(message, status = null) {
    super(message);
    this.status = status;
  }
}

export class Chat {
  constructor(root) {
    this.log = root.querySelector("#chat-log");
    this.form = root.querySelector("#chat-form");
    this.input = root.querySelector("#chat-input");
    this.sendButton = root.querySelector("#chat-send");
    this.stopButton = root.querySelector("#chat-stop");
    this.modelSlot = root.querySelector("#model-slot");
    this.temperature = root.querySelector("#chat-temperature");
    this.maxTokens = root.querySelector("#chat-max-tokens");
    this.ignoreEos = root.querySelector("#chat-ignore-eos");
    this.history = []; // finished turns, sent with every request
    this.conversation = 0; // bumped by Clear, so an answer that ends afterwards does not revive the old one
    this.controller = null;
    this.modelField = null;
    this.bind(root);
    this.restoreSettings();
    this.showEmpty();
  }

  bind(root) {
    this.form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    this.input.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.send();
      }
    });
    this.stopButton.addEventListener("click", () => this.controller && this.controller.abort());
    root.querySelector("#chat-clear").addEventListener("click", () => this.clear());
    for (const field of [this.temperature, this.maxTokens, this.ignoreEos]) {
      field.addEventListener("change", () => this.saveSettings());
    }
  }

  // Called with every cluster picture; the model list is re-read when the cluster's model changes.
  setCluster(modelChanged) {
    if (modelChanged || !this.modelField) this.loadModels();
  }

  async loadModels() {
    let models = [];
    try {
      const response = await fetch("/v1/models");
      // /v1/models also lists the catalog and cached models; only the one being served can answer now.
      if (response.ok) {
        models = (await response.json()).data.filter((model) => model.state === "serving").map((model) => model.id);
      }
    } catch (error) {
      return; // the event stream shows the node as unreachable; keep the current picker
    }
    const previous = this.modelField ? this.modelField.value : "";
    if (models.length) {
      this.modelField = h("select", { id: "chat-model", "aria-label": "Model" },
        models.map((id) => h("option", { value: id, selected: id === previous }, id)));
    } else {
      // No model yet: the first request names one for the cluster (a hub repo or catalog name every node can
      // fetch, demo, or a folder every node can read).
      this.modelField = h("input", { id: "chat-model", "aria-label": "Model", value: previous,
        placeholder: "model: org/repo, a catalog name, demo or a folder" });
    }
    replace(this.modelSlot, this.modelField);
  }

  restoreSettings() {
    try {
      const saved = JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}");
      this.temperature.value = saved.temperature ?? "";
      this.maxTokens.value = saved.maxTokens ?? "";
      this.ignoreEos.checked = Boolean(saved.ignoreEos);
    } catch (error) {
      localStorage.removeItem(SETTINGS_KEY);
    }
  }

  saveSettings() {
    localStorage.setItem(SETTINGS_KEY, JSON.stringify({
      temperature: this.temperature.value, maxTokens: this.maxTokens.value, ignoreEos: this.ignoreEos.checked }));
  }

  showEmpty() {
    replace(this.log, h("div", { class: "chat-empty" },
      h("strong", {}, "Chat with the cluster's model."),
      h("p", {}, "Answers stream from this node through every node of the ring. Enter sends, Shift+Enter " +
        "adds a line; Settings holds temperature and max tokens.")));
  }

  clear() {
    if (this.controller) this.controller.abort();
    this.conversation += 1;
    this.history = [];
    this.showEmpty();
  }

  requestBody(messages) {
    const body = { model: this.modelField ? this.modelField.value.trim() : "", messages, stream: true,
      stream_options: { include_usage: true } };
    if (this.temperature.value !== "") body.temperature = Number(this.temperature.value);
    if (this.maxTokens.value !== "") body.max_tokens = Number.parseInt(this.maxTokens.value, 10);
    if (this.ignoreEos.checked) body.ignore_eos = true; // exo-like's extension (as in vLLM)
    return body;
  }

  async send() {
    const text = this.input.value.trim();
    if (!text || this.controller) return;
    const empty = this.log.querySelector(".chat-empty");
    if (empty) empty.remove();
    const messages = [...this.history, { role: "user", content: text }];
    const conversation = this.conversation;
    this.input.value = "";
    this.log.append(h("div", { class: "msg user" }, h("div", { class: "msg-text" }, text)));
    const answer = new Answer(this.log);
    this.controller = new AbortController();
    this.setStreaming(true);
    const outcome = await answer.stream(this.requestBody(messages), this.controller.signal);
    this.controller = null;
    this.setStreaming(false);
    if (outcome.text && conversation === this.conversation) {
      this.history = [...messages, { role: "assistant", content: outcome.text }];
    }
    this.input.focus();
  }

  setStreaming(streaming) {
    this.sendButton.hidden = streaming;
    this.stopButton.hidden = !streaming;
  }
}

// One assistant answer: its text as it streams, then tokens, speed and time to first token (or the error).
class Answer {
  constructor(log) {
    this.log = log;
    this.text = h("div", { class: "msg-text" });
    this.meta = h("div", { class: "msg-meta" }, "waiting for the first token…");
    this.el = h("div", { class: "msg assistant", "data-state": "streaming" }, this.text, this.meta);
    log.append(this.el);
    this.scroll();
  }

  async stream(body, signal) {
    const started = performance.now();
    const timing = { started, first: null, last: null, chunks: 0, usage: null };
    let content = "";
    try {
      const response = await fetch("/v1/chat/completions", { method: "POST", signal, body: JSON.stringify(body),
        headers: { "Content-Type": "application/json", Accept: "text/event-stream" } });
      if (!response.ok) throw new ApiError(await errorText(response), response.status);
      for await (const chunk of sseChunks(response.body)) {
        if (chunk.error) throw new ApiError(chunk.error.message);
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta.content;
        if (chunk.usage) timing.usage = chunk.usage;
        if (!delta) continue;
        const now = performance.now();
        timing.first = timing.first ?? now;
        timing.last = now;
        timing.chunks += 1;
        content += delta;
        this.text.textContent = content;
        this.meta.textContent = `streaming · ${summary(timing)}`;
        this.scroll();
      }
      this.finish("done", summary(timing));
    } catch (error) {
      if (error.name === "AbortError") this.finish("stopped", `Stopped. ${summary(timing)}`);
      else this.finish("error", describeError(error));
      if (error.name !== "AbortError") content = "";
    }
    return { text: content };
  }

  finish(state, meta) {
    this.el.dataset.state = state;
    this.meta.textContent = meta;
    this.scroll();
  }

  scroll() {
    this.log.scrollTop = this.log.scrollHeight;
  }
}

// The data of each server-sent event, parsed, up to [DONE]. A stream that stops before [DONE] lost its node.
async function* sseChunks(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) throw new Error("the connection closed before the answer was complete");
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    if (body.error && body.error.message) return body.error.message;
  } catch (error) {
    // not JSON: fall through to the status line
  }
  return response.statusText || "no details";
}

function describeError(error) {
  if (error instanceof ApiError) {
    return error.status ? `Error ${error.status}: ${error.message}` : `Error: ${error.message}`;
  }
  if (error instanceof TypeError) return `Could not reach this node (${error.message}). Is it still running?`;
  return `Error: ${error.message}`;
}

function summary(timing) {
  const tokens = timing.usage ? timing.usage.completion_tokens : timing.chunks;
  if (!tokens || timing.first === null) return "No tokens.";
  const parts = [timing.usage ? plural(tokens, "token") : `~${plural(tokens, "token")}`];
  const decodeSeconds = (timing.last - timing.first) / 1000;
  if (tokens > 1 && decodeSeconds > 0) parts.push(formatRate((tokens - 1) / decodeSeconds));
  parts.push(`first token ${formatSeconds((timing.first - timing.started) / 1000)}`);
  return parts.join(" · ");
}
