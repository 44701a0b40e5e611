// The chat page: talks only to this server's OpenAI API (/v1/models, /v1/chat/completions, streamed)
// and keeps the conversation and settings in the browser's local storage.
"use strict";

const STORE = "peregrine.chat.v1";
const $ = (id) => document.getElementById(id);
const SETTINGS = { system: "system", temperature: "temperature", top_p: "top-p", max_tokens: "max-tokens", api_key: "api-key" };

let state = load();
let running = null; // the AbortController of the reply being streamed

function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE));
    if (saved && Array.isArray(saved.messages)) return saved;
  } catch (_) { /* a corrupt entry starts a fresh chat */ }
  return { messages: [], settings: {}, model: null };
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(state));
}

function headers() {
  const h = { "content-type": "application/json" };
  if (state.settings.api_key) h.authorization = `Bearer ${state.settings.api_key}`;
  return h;
}

function status(text) {
  $("status").textContent = text;
}

// One message's element; assistant text is rendered as Markdown, user text shown as typed.
function messageElement(message) {
  const el = document.createElement("div");
  el.className = `message ${message.role}${message.error ? " error" : ""}`;
  const role = document.createElement("span");
  role.className = "role";
  role.textContent = message.role;
  const body = document.createElement("div");
  body.className = "content";
  el.append(role, body);
  fill(el, message);
  return el;
}

function fill(el, message) {
  const body = el.querySelector(".content");
  if (message.role === "user") body.textContent = message.content;
  else body.innerHTML = renderMarkdown(message.content);
  if (message.reasoning) {
    const thinking = document.createElement("details");
    thinking.innerHTML = `<summary>Thinking</summary>${renderMarkdown(message.reasoning)}`;
    body.prepend(thinking);
  }
  const note = message.error || (message.stopped ? "[stopped]" : "");
  if (note) {
    const p = document.createElement("p");
    p.className = "note";
    p.textContent = note;
    body.append(p);
  }
}

function renderAll() {
  const box = $("messages");
  box.replaceChildren(...state.messages.map(messageElement));
  box.scrollTop = box.scrollHeight;
}

async function loadModels() {
  const select = $("model");
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    const body = await response.json();
    if (!response.ok) throw new Error(body.error ? body.error.message : response.statusText);
    select.replaceChildren(...body.data.map((m) => new Option(m.id, m.id)));
    if (state.model && body.data.some((m) => m.id === state.model)) select.value = state.model;
    state.model = select.value;
    status("");
  } catch (e) {
    status(`Could not list models: ${e.message}`);
  }
}

// Reads a `text/event-stream` body, calling `onData` with each parsed `data:` payload.
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue; // comments are keep-alives
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onData(JSON.parse(data));
      }
    }
  }
}

function requestBody() {
  const s = state.settings;
  const messages = state.messages.filter((m) => !m.error).map(({ role, content }) => ({ role, content }));
  if (s.system && s.system.trim()) messages.unshift({ role: "system", content: s.system });
  const body = { model: state.model, messages, stream: true, stream_options: { include_usage: true } };
  for (const [key, parse] of [["temperature", parseFloat], ["top_p", parseFloat], ["max_tokens", (v) => parseInt(v, 10)]]) {
    const value = parse(s[key]);
    if (Number.isFinite(value)) body[key] = value;
  }
  return body;
}

async function send(text) {
  state.messages.push({ role: "user", content: text });
  const reply = { role: "assistant", content: "" };
  const body = requestBody();
  state.messages.push(reply);
  renderAll();
  const el = $("messages").lastElementChild;
  running = new AbortController();
  setRunning(true);
  const started = performance.now();
  let usage = null;
  let pending = false;
  const redraw = () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      fill(el, reply);
      $("messages").scrollTop = $("messages").scrollHeight;
    });
  };
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: running.signal,
    });
    if (!response.ok) {
      const err = await response.json().catch(() => ({}));
      throw new Error(err.error ? err.error.message : `HTTP ${response.status}`);
    }
    await readEvents(response, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (!delta) return;
      if (delta.content) reply.content += delta.content;
      const thought = delta.reasoning_content || delta.reasoning;
      if (thought) reply.reasoning = (reply.reasoning || "") + thought;
      redraw();
    });
    const seconds = (performance.now() - started) / 1000;
    status(usage ? `${usage.completion_tokens} tokens in ${seconds.toFixed(1)} s (prompt ${usage.prompt_tokens})` : "");
  } catch (e) {
    if (e.name === "AbortError") {
      reply.stopped = true;
      status("Stopped.");
    } else {
      reply.error = e.message;
      status("");
    }
  } finally {
    running = null;
    setRunning(false);
    fill(el, reply);
    save();
  }
}

function setRunning(on) {
  $("send").disabled = on;
  $("stop").hidden = !on;
  $("model").disabled = on;
}

function bindSettings() {
  for (const [key, id] of Object.entries(SETTINGS)) {
    const input = $(id);
    if (state.settings[key] !== undefined) input.value = state.settings[key];
    else state.settings[key] = input.value;
    input.addEventListener("change", () => {
      state.settings[key] = input.value;
      save();
      if (key === "api_key") loadModels();
    });
  }
}

function main() {
  bindSettings();
  renderAll();
  loadModels();
  $("model").addEventListener("change", (e) => {
    state.model = e.target.value;
    save();
  });
  $("new-chat").addEventListener("click", () => {
    if (running) running.abort();
    state.messages = [];
    save();
    renderAll();
    status("");
  });
  $("stop").addEventListener("click", () => running && running.abort());
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("input").value.trim();
    if (!text || running || !state.model) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
}

main();
