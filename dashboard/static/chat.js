// The chat panel: streams from this node's own /v1/chat/completions, so every answer crosses the whole ring.
// Stop aborts the fetch; the node sees the client go away and frees the request on every stage. On request, each
// token is shown with its probability (and the likeliest alternatives on hover); tool calls show as they come.

import { errorText, formatRate, formatSeconds, h, plural, replace } from "./util.js";

const SETTINGS_KEY = "exo-like.chat.settings";
const TOP_ALTERNATIVES = 5; // alternatives shown beside each token when probabilities are on
const OTHER_MODEL = ""; // the picker's "another model…" (no model is named with nothing)

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
    this.logprobs = root.querySelector("#chat-logprobs");
    this.tools = root.querySelector("#chat-tools");
    this.toolChoice = root.querySelector("#chat-tool-choice");
    this.history = []; // finished turns, sent with every request
    this.conversation = 0; // bumped by Clear, so an answer that ends afterwards does not revive the old one
    this.controller = null;
    this.modelField = null; // the model picker (a select), or a text field while nothing is loaded
    this.otherField = null; // the text field for a model the picker does not list
    this.offered = undefined; // the models the picker lists, one a line, as last shown
    this.preferred = null; // a model just launched: chosen as soon as the picker lists it
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
    for (const field of [this.temperature, this.maxTokens, this.ignoreEos, this.logprobs, this.tools,
      this.toolChoice]) {
      field.addEventListener("change", () => this.saveSettings());
    }
  }

  // Called with every cluster picture: the picker offers the models of the cluster's instances (loading ones too:
  // a streamed request waits for its model's load), and "another model…" for any name (the cluster loads it on
  // demand). Redrawn only when that list changes, so an open picker is not changed under the pointer.
  setCluster(picture) {
    // One entry for a model with several instances: each request goes to the instance the cluster picks.
    const models = [...new Set((picture.instances || []).map((instance) => instance.model_name || instance.model))];
    const offered = models.join("\n");
    if (this.modelField && offered === this.offered) return;
    this.offered = offered;
    this.showModels(models);
  }

  // The model just launched from the Models panel is the one to chat with, as soon as the picker lists it.
  prefer(name) {
    this.preferred = name;
    if (this.offered !== undefined) this.showModels(this.offered ? this.offered.split("\n") : []);
  }

  // The chosen model's name: the picker's, or the text typed for a model it does not list.
  modelName() {
    const field = this.typing() ? this.otherField || this.modelField : this.modelField;
    return field ? field.value.trim() : "";
  }

  // Whether the model is being named in a text field (nothing loaded yet, or "another model…" picked).
  typing() {
    return Boolean(this.modelField) && (this.modelField.tagName === "INPUT" || this.modelField.value === OTHER_MODEL);
  }

  showModels(models) {
    const previous = this.modelName();
    const typed = this.typing() && previous !== "";
    const focused = document.activeElement === this.modelField || document.activeElement === this.otherField;
    if (!models.length) {
      // Nothing loaded: the first request names the model (a hub repo or catalog name every node can fetch, demo,
      // or a folder every node can read) and the cluster loads it.
      if (this.modelField && this.modelField.tagName === "INPUT") return; // already the text field, as typed
      this.modelField = modelText("chat-model", "Model", previous);
      this.otherField = null;
      replace(this.modelSlot, this.modelField);
      if (focused) this.modelField.focus();
      return;
    }
    if (!this.modelField || this.modelField.tagName !== "SELECT") {
      this.modelField = h("select", { id: "chat-model", "aria-label": "Model", onchange: () => this.showOther(true) });
      this.otherField = modelText("chat-model-other", "Another model", "");
      replace(this.modelSlot, this.modelField, this.otherField);
    }
    // A name the user typed is kept (in "another model…"); a listed model that is gone gives way to the first.
    const chosen = models.includes(this.preferred) ? this.preferred : models.includes(previous) ? previous
      : typed ? OTHER_MODEL : models[0];
    if (models.includes(this.preferred)) this.preferred = null; // applied once: the user's later choice stands
    replace(this.modelField, models.map((id) => h("option", { value: id }, id)),
      h("option", { value: OTHER_MODEL }, "another model…"));
    this.modelField.value = chosen;
    if (chosen === OTHER_MODEL) this.otherField.value = previous;
    this.showOther(false);
    if (focused) (chosen === OTHER_MODEL ? this.otherField : this.modelField).focus();
  }

  // The text field for another model shows while "another model…" is picked.
  showOther(focus) {
    const other = this.modelField.value === OTHER_MODEL;
    this.otherField.hidden = !other;
    if (other && focus) this.otherField.focus();
  }

  restoreSettings() {
    try {
      const saved = JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}");
      this.temperature.value = saved.temperature ?? "";
      this.maxTokens.value = saved.maxTokens ?? "";
      this.ignoreEos.checked = Boolean(saved.ignoreEos);
      this.logprobs.checked = Boolean(saved.logprobs);
      this.tools.value = saved.tools ?? "";
      this.toolChoice.value = saved.toolChoice ?? "auto";
    } catch (error) {
      localStorage.removeItem(SETTINGS_KEY);
    }
  }

  saveSettings() {
    localStorage.setItem(SETTINGS_KEY, JSON.stringify({
      temperature: this.temperature.value, maxTokens: this.maxTokens.value, ignoreEos: this.ignoreEos.checked,
      logprobs: this.logprobs.checked, tools: this.tools.value, toolChoice: this.toolChoice.value }));
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
    const body = { model: this.modelName(), messages, stream: true,
      stream_options: { include_usage: true } };
    if (this.temperature.value !== "") body.temperature = Number(this.temperature.value);
    if (this.maxTokens.value !== "") body.max_tokens = Number.parseInt(this.maxTokens.value, 10);
    if (this.ignoreEos.checked) body.ignore_eos = true; // exo-like's extension (as in vLLM)
    if (this.logprobs.checked) Object.assign(body, { logprobs: true, top_logprobs: TOP_ALTERNATIVES });
    if (this.tools.value.trim()) {
      body.tools = JSON.parse(this.tools.value); // a typo is reported as the answer's error
      body.tool_choice = this.toolChoice.value;
    }
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
    const outcome = await answer.stream(() => this.requestBody(messages), this.controller.signal);
    this.controller = null;
    this.setStreaming(false);
    if ((outcome.text || outcome.calls.length) && conversation === this.conversation) {
      const reply = { role: "assistant", content: outcome.text };
      if (outcome.calls.length) reply.tool_calls = outcome.calls;
      this.history = [...messages, reply];
    }
    this.input.focus();
  }

  setStreaming(streaming) {
    this.sendButton.hidden = streaming;
    this.stopButton.hidden = !streaming;
  }
}

// A text field for a model's name, suggesting what GET /v1/models lists (the Models panel fills the datalist).
function modelText(id, label, value) {
  return h("input", { id, "aria-label": label, value, list: "model-names", autocomplete: "off",
    placeholder: "model: org/repo, a catalog name, demo or a folder" });
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

  async stream(makeBody, signal) {
    const started = performance.now();
    const timing = { started, first: null, last: null, chunks: 0, usage: null };
    let content = "";
    const calls = []; // tool calls as OpenAI streams them: by index, the arguments arriving in pieces
    try {
      const response = await fetch("/v1/chat/completions", { method: "POST", signal,
        body: JSON.stringify(makeBody()),
        headers: { "Content-Type": "application/json", Accept: "text/event-stream" } });
      if (!response.ok) throw new ApiError(await errorText(response), response.status);
      for await (const chunk of sseChunks(response.body)) {
        if (chunk.error) throw new ApiError(chunk.error.message);
        if (chunk.usage) timing.usage = chunk.usage;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) continue;
        const delta = choice.delta || {};
        if (!delta.content && !delta.tool_calls) continue;
        const now = performance.now();
        timing.first = timing.first ?? now;
        timing.last = now;
        timing.chunks += 1;
        if (delta.content) {
          content += delta.content;
          this.addText(delta.content, choice.logprobs && choice.logprobs.content);
        }
        for (const call of delta.tool_calls || []) this.addCall(calls, call);
        this.meta.textContent = `streaming · ${summary(timing)}`;
        this.scroll();
      }
      this.finish("done", summary(timing));
    } catch (error) {
      if (error.name === "AbortError") this.finish("stopped", `Stopped. ${summary(timing)}`);
      else this.finish("error", describeError(error));
      if (error.name !== "AbortError") {
        content = "";
        calls.length = 0;
      }
    }
    return { text: content, calls: calls.map((call) => call.message) };
  }

  // Text as it arrives; with probabilities, one span per token, its band by probability, alternatives on hover.
  // When the delta is not its tokens' texts end to end (a character split across tokens, a stop string cut),
  // the delta is one span with its least likely token's band.
  addText(text, entries) {
    if (!entries || !entries.length) {
      this.text.append(text);
      return;
    }
    if (entries.map((entry) => entry.token).join("") !== text) {
      const least = entries.reduce((a, b) => (b.logprob < a.logprob ? b : a));
      this.text.append(tokenSpan(text, least));
      return;
    }
    for (const entry of entries) this.text.append(tokenSpan(entry.token, entry));
  }

  addCall(calls, delta) {
    let call = calls[delta.index];
    if (!call) {
      call = calls[delta.index] = { message: { id: delta.id, type: "function",
        function: { name: delta.function.name, arguments: "" } } };
      call.args = h("span", { class: "tool-args" });
      this.el.insertBefore(h("div", { class: "tool-call" }, "→ ",
        h("span", { class: "tool-name" }, delta.function.name), "(", call.args, ")"), this.meta);
    }
    call.message.function.arguments += delta.function.arguments || "";
    call.args.textContent = call.message.function.arguments;
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

function tokenSpan(text, entry) {
  const probability = Math.exp(entry.logprob);
  const band = probability >= 0.6 ? "high" : probability >= 0.2 ? "mid" : "low";
  const others = (entry.top_logprobs || []).map((top) => `${JSON.stringify(top.token)} ` +
    `${(Math.exp(top.logprob) * 100).toFixed(1)}%`).join("\n");
  return h("span", { class: "tok", "data-band": band,
    title: `${(probability * 100).toFixed(1)}%${others ? "\n" + others : ""}` }, text);
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
