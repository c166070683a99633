// The demo chat: one WebSocket to /v1/chat/ws (protocol in docs/api.md). The page keeps
// the conversation and sends it whole with every turn; deltas stream into the last bubble.
"use strict";

const $ = (id) => document.getElementById(id);
const log = $("log"), input = $("input"), statusEl = $("status");
let socket = null, nextId = 1, running = null;
let history = [];

function bubble(cls, text) {
  const el = document.createElement("div");
  el.className = "msg " + cls;
  el.textContent = text;
  log.appendChild(el);
  log.scrollTop = log.scrollHeight;
  return el;
}

function setRunning(gen) {
  running = gen;
  $("stop").disabled = !gen;
  $("send").disabled = !!gen;
}

function connect() {
  const key = $("api_key").value.trim();
  const protocols = ["streamkv"];
  if (key) protocols.push("bearer." + key);
  const scheme = location.protocol === "https:" ? "wss://" : "ws://";
  socket = new WebSocket(scheme + location.host + "/v1/chat/ws", protocols);
  statusEl.textContent = "connecting…";
  socket.onopen = () => { statusEl.textContent = "connected"; };
  socket.onclose = () => {
    statusEl.textContent = "disconnected (check the API key, or reload)";
    if (running) finish(running, "disconnected");
    socket = null;
  };
  socket.onmessage = (ev) => onMessage(JSON.parse(ev.data));
}

function onMessage(msg) {
  const gen = running && running.id === msg.id ? running : null;
  if (msg.type === "delta" && gen) {
    gen.text += msg.text;
    gen.el.textContent = gen.text;
    log.scrollTop = log.scrollHeight;
  } else if (msg.type === "done" && gen) {
    const u = msg.usage || {};
    finish(gen, `${msg.finish_reason} · ${u.prompt_tokens} prompt + ${u.completion_tokens} completion tokens`);
  } else if (msg.type === "error") {
    bubble("error", (msg.error && msg.error.message) || "error");
    if (gen) finish(gen, "error");
  }
}

function finish(gen, note) {
  const meta = document.createElement("span");
  meta.className = "meta";
  meta.textContent = note;
  gen.el.appendChild(meta);
  if (gen.text) history.push({ role: "assistant", content: gen.text });
  setRunning(null);
}

function send(text) {
  if (!socket || socket.readyState > WebSocket.OPEN) connect();
  if (socket.readyState === WebSocket.CONNECTING) {
    socket.addEventListener("open", () => send(text), { once: true });
    return;
  }
  history.push({ role: "user", content: text });
  bubble("user", text);
  const gen = { id: "m" + nextId++, text: "", el: bubble("assistant", "") };
  setRunning(gen);
  const params = { max_tokens: Number($("max_tokens").value), temperature: Number($("temperature").value) };
  socket.send(JSON.stringify({ type: "chat", id: gen.id, messages: history, params }));
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = input.value.trim();
  if (!text || running) return;
  input.value = "";
  send(text);
});
input.addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => {
  if (running && socket) socket.send(JSON.stringify({ type: "cancel", id: running.id }));
});
$("reset").addEventListener("click", () => { history = []; log.replaceChildren(); });
$("api_key").addEventListener("change", () => { if (socket) socket.close(); connect(); });
connect();
