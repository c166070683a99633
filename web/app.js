// The chat page: conversations (store.js), replies streamed by transport.js, model output
// rendered by markdown.js. One reply generates at a time; its stats are measured here, in
// the browser, as a user sees them (time to first token includes queueing and delivery).
"use strict";

import { button, messageEl } from "./messages.js";
import { append, history, markFailed, newId, showBranch, Store } from "./store.js";
import { KVView } from "./kv.js";
import { attachText, exportConversations, importConversations, noticeIn, onFile, statusIn, themeToggle } from "./page_tools.js";
import { authHeaders, ChatSocket, startHttpStream, startHttpWhole } from "./transport.js";

const $ = (id) => document.getElementById(id);
const store = new Store();
const SETTING_IDS = ["system", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "beam_width"];
const apiKey = () => sessionStorage.getItem("streamkv.api_key") || "";
let active = null; // the generation in flight
let editing = null; // id of the user message being edited

const notice = noticeIn($("notice"));
const showStatus = statusIn($("status"), apiKey, () => setRunning(!!active));
const socket = new ChatSocket({ apiKey, onStatus: showStatus });
store.onError = notice;

// -- parameters ------------------------------------------------------------------------
function requestParams() {
  const s = store.settings, p = {};
  const num = (v) => (v === "" || v === null || v === undefined ? null : Number(v));
  if (num(s.max_tokens) !== null) p.max_tokens = num(s.max_tokens);
  if (num(s.temperature) !== null) p.temperature = num(s.temperature);
  if (num(s.top_p) !== null) p.top_p = num(s.top_p);
  if (num(s.top_k) !== null) p.top_k = num(s.top_k);
  if (num(s.seed) !== null) p.seed = num(s.seed);
  const n = num(s.n) ?? 1, beam = num(s.beam_width) ?? 0;
  if (beam >= 2) return { mode: "beam", params: { ...p, n: Math.min(n, beam), best_of: beam, use_beam_search: true, temperature: 0 } };
  if (n > 1) return { mode: "samples", params: { ...p, n } };
  return { mode: "socket", params: p };
}

// What the message buttons do (messages.js draws them).
const ui = {
  editing: () => editing,
  startEdit(msg) { if (!active) { editing = msg.id; renderLog(); } },
  cancelEdit() { editing = null; renderLog(); },
  saveEdit: (conv, msg, text) => resendEdited(conv, msg, text),
  chooseSample(msg, i) { msg.chosen = i; msg.content = msg.choices[i] || ""; store.save(); renderLog(); },
  showVersion(conv, other) { if (!active) { editing = null; showBranch(conv, other); store.save(); renderLog(); } },
  regenerate: (conv, msg) => regenerate(conv, msg),
  continueReply: (conv, msg) => continueReply(conv, msg),
};

function renderLog() {
  const conv = store.current, log = $("log");
  const stick = log.scrollHeight - log.scrollTop - log.clientHeight < 80;
  log.replaceChildren(...conv.messages.map((m) => messageEl(conv, m, ui)));
  if (!conv.messages.length) {
    log.appendChild(Object.assign(document.createElement("p"), { className: "empty", textContent: "Start a conversation below." }));
  }
  if (stick) log.scrollTop = log.scrollHeight;
  renderSidebar();
}

function renderMessage(conv, msg) {
  if (store.currentId !== conv.id) return;
  const old = $("log").querySelector(`.msg[data-id="${msg.id}"]`);
  if (!old) return renderLog();
  const log = $("log");
  const stick = log.scrollHeight - log.scrollTop - log.clientHeight < 80;
  old.replaceWith(messageEl(conv, msg, ui));
  if (stick) log.scrollTop = log.scrollHeight;
}

function renderSidebar() {
  const list = $("conversations");
  list.replaceChildren(...store.conversations.map((c) => {
    const li = document.createElement("li");
    li.classList.toggle("current", c.id === store.currentId);
    const open = button(c.title, () => { if (!active) { editing = null; store.select(c.id); renderLog(); closeSidebarOnPhone(); } }, "conv-title");
    const del = button("×", () => {
      if (active && active.conv === c) return;
      if (!confirm(`Delete "${c.title}"? This cannot be undone (Export keeps a copy).`)) return;
      store.remove(c.id);
      renderLog();
    }, "conv-delete");
    del.title = "delete this conversation";
    li.append(open, del);
    return li;
  }));
}

function setRunning(on) {
  $("stop").hidden = !on;
  $("send").disabled = on || !socket.connected;
  $("send").title = socket.connected ? "" : "not connected to the server";
}

// -- generation ------------------------------------------------------------------------
// A new reply under `parent`, or more of `cont` (a reply cut at max tokens).
function generate(conv, { parent = conv.leaf, cont = null } = {}) {
  const { mode, params } = requestParams();
  let messages, msg, base = "";
  if (cont) {
    messages = history(conv, store.settings.system);
    Object.assign(params, { continue_final_message: true, add_generation_prompt: false });
    msg = cont;
    base = msg.content;
    msg.pending = true;
  } else {
    const upTo = conv.messages.findIndex((m) => m.id === parent) + 1;
    messages = history(conv, store.settings.system, upTo);
    msg = append(conv, { role: "assistant", content: "", pending: true }, parent);
  }
  // Every reply (WebSocket or HTTP) is named with the KV view's token, so the view marks its
  // block table exactly: the server's id for it is "chatcmpl-" + this.
  params.request_id = `web-${kv.token}-${newId()}`;
  kv.follow("chatcmpl-" + params.request_id);
  store.save();
  renderLog();
  const gen = { conv, msg, t0: performance.now(), tFirst: null, deltas: 0, texts: [], frame: 0, saved: 0 };
  const redraw = () => {
    if (gen.frame) return;
    gen.frame = requestAnimationFrame(() => { gen.frame = 0; renderMessage(conv, msg); });
  };
  const cb = {
    onDelta(i, text) {
      const now = performance.now();
      if (gen.tFirst === null) gen.tFirst = now;
      gen.deltas++;
      gen.texts[i] = (gen.texts[i] || "") + text;
      if (gen.texts.length > 1) msg.choices = Array.from(gen.texts, (t) => t || "");
      msg.content = base + (gen.texts[msg.chosen || 0] || "");
      const secs = (now - gen.tFirst) / 1000;
      // A delta is about one token; the exact count comes with the end of the reply.
      msg.stats = { live: true, tokens: null, ttft_ms: gen.tFirst - gen.t0, tps: secs > 0.2 ? (gen.deltas - 1) / secs : null };
      if (now - gen.saved > 1000) { gen.saved = now; store.save(); }
      redraw();
    },
    onDone(done) {
      if (active !== gen) return;
      const now = performance.now();
      const tokens = done.usage ? done.usage.completion_tokens : null;
      const samples = Math.max(1, gen.texts.length);
      const span = gen.tFirst === null ? 0 : (now - gen.tFirst) / 1000;
      // Streamed: tokens after each sample's first, over the time since the first arrived.
      // Answered whole (beam search): every token over the whole wait.
      let tps = null;
      if (tokens !== null && mode === "beam") tps = tokens / ((now - gen.t0) / 1000);
      else if (tokens !== null && span > 0 && tokens > samples) tps = (tokens - samples) / span;
      msg.stats = { live: false, tokens, finish_reason: done.finish_reason,
                    ttft_ms: gen.tFirst === null ? null : gen.tFirst - gen.t0, tps };
      end(gen);
    },
    onError(message) {
      if (active !== gen) return;
      markFailed(conv, msg, message);
      end(gen);
    },
  };
  active = gen;
  setRunning(true);
  const key = apiKey();
  gen.stop = mode === "socket" ? socket.start(messages, params, cb)
    : mode === "samples" ? startHttpStream(messages, params, key, cb)
      : startHttpWhole(messages, params, key, cb);
}

function end(gen) {
  cancelAnimationFrame(gen.frame);
  gen.msg.pending = false;
  active = null;
  setRunning(false);
  store.save();
  renderLog();
}

function updateTitle(conv) {
  const first = conv.messages.find((m) => m.role === "user");
  if (first && conv.title === "New chat") conv.title = first.content.slice(0, 48);
}

function sendMessage(text) {
  const conv = store.current;
  append(conv, { role: "user", content: text });
  updateTitle(conv);
  generate(conv);
}

// A new version of a reply, kept beside the old one (‹1/2›).
function regenerate(conv, msg) {
  if (active) return;
  const user = conv.nodes.find((m) => m.id === msg.parent);
  if (user) user.failed = false;
  generate(conv, { parent: msg.parent });
}

function continueReply(conv, msg) {
  if (active) return;
  generate(conv, { cont: msg });
}

// An edited message is a new version of it; the old one and its replies stay a branch.
function resendEdited(conv, msg, text) {
  if (active || !text.trim()) return;
  editing = null;
  const edited = append(conv, { role: "user", content: text.trim() }, msg.parent);
  generate(conv, { parent: edited.id });
}

// -- the model card --------------------------------------------------------------------
async function loadModel() {
  const el = $("model");
  try {
    const resp = await fetch("/v1/models", { headers: authHeaders(apiKey()) });
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    const card = (await resp.json()).data[0];
    const limits = Object.entries(card)
      .filter(([k, v]) => typeof v === "number" && k !== "created")
      .map(([k, v]) => `${k.replace(/_/g, " ")} ${v}`);
    el.textContent = [card.id, ...limits].join(" · ");
    el.dataset.model = card.id;
    if (card.max_model_len) $("max_tokens").max = String(card.max_model_len);
  } catch (e) {
    el.textContent = `model unknown (${e.message})`;
    setTimeout(loadModel, 5000);
  }
}

// -- wiring ----------------------------------------------------------------------------
function closeSidebarOnPhone() {
  if (matchMedia("(max-width: 760px)").matches) document.body.classList.remove("sidebar-open");
}

for (const id of SETTING_IDS) {
  const input = $(id);
  input.value = store.settings[id] ?? "";
  input.addEventListener("change", () => { store.settings[id] = input.value; store.saveSettings(); });
}
$("api_key").value = apiKey();
$("api_key").addEventListener("change", () => {
  sessionStorage.setItem("streamkv.api_key", $("api_key").value.trim());
  socket.reconnect();
  loadModel();
  if (!$("kvpane").hidden) { kv.stop(); kv.start(); }
});
$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("input").value.trim();
  if (!text || active) return;
  $("input").value = "";
  sendMessage(text);
});
$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => { if (active) active.stop(); });
$("new-chat").addEventListener("click", () => {
  if (active) return;
  editing = null;
  const empty = store.conversations.find((c) => !c.messages.length);
  if (empty) store.select(empty.id); else store.create();
  renderLog();
  closeSidebarOnPhone();
  $("input").focus();
});
$("toggle-sidebar").addEventListener("click", () => document.body.classList.toggle("sidebar-open"));
$("export").addEventListener("click", () => exportConversations(store));
onFile($("attach"), $("attach-file"), (f) => attachText($("input"), f, notice));
onFile($("import"), $("import-file"), async (f) => { await importConversations(store, f, notice); renderLog(); });
themeToggle($("toggle-theme"));

// The KV view streams only while it is shown: a hidden pane costs the server nothing.
const kv = new KVView($("kv-root"), apiKey);
function showKV(on) {
  $("kvpane").hidden = !on;
  $("toggle-kv").setAttribute("aria-pressed", String(on));
  localStorage.setItem("streamkv.kv.open", on ? "1" : "");
  if (on) kv.start(); else kv.stop();
}
$("toggle-kv").addEventListener("click", () => showKV($("kvpane").hidden));
showKV(localStorage.getItem("streamkv.kv.open") === "1");

renderLog();
setRunning(false);
socket.connect();
loadModel();
// For the browser tests and the curious: the page's state, from the devtools console.
window.streamkv = { store, kv, socket };
