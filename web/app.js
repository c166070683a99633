// The chat page: conversations (store.js), replies streamed by transport.js, model output
// rendered by markdown.js. One reply generates at a time; its stats are measured here, in
// the browser, as a user sees them (time to first token includes queueing and delivery).
"use strict";

import { enhance, renderMarkdown } from "./markdown.js";
import { append, history, markFailed, newId, showBranch, siblings, Store } from "./store.js";
import { KVView } from "./kv.js";
import { authHeaders, ChatSocket, startHttpStream, startHttpWhole } from "./transport.js";

const $ = (id) => document.getElementById(id);
const store = new Store();
const SETTING_IDS = ["system", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "beam_width"];
const apiKey = () => sessionStorage.getItem("streamkv.api_key") || "";
let active = null; // the generation in flight
let editing = null; // id of the user message being edited

const socket = new ChatSocket({ apiKey, onStatus: showStatus });
store.onError = notice;

// -- connection state ------------------------------------------------------------------
// The header says what is known: connected, or why not (the server is unreachable, or it
// wants an API key) with a live countdown to the next attempt. Send is off meanwhile.
let statusTimer = 0, statusWhy = "";
function showStatus(state, text, retryAt) {
  clearInterval(statusTimer);
  const el = $("status");
  el.dataset.state = state;
  setRunning(!!active);
  if (state !== "disconnected") { el.textContent = text; statusWhy = ""; return; }
  const draw = () => {
    const secs = Math.max(0, Math.ceil((retryAt - Date.now()) / 1000));
    el.textContent = `${statusWhy || "server unreachable"} · retrying in ${secs} s`;
  };
  draw();
  statusTimer = setInterval(draw, 500);
  fetch("/v1/models", { headers: authHeaders(apiKey()) }).then((r) => {
    statusWhy = r.status === 401 ? "the server needs an API key (Settings)" : r.ok ? "chat socket closed" : `server error ${r.status}`;
  }, () => { statusWhy = "server unreachable"; }).finally(draw);
}

function notice(text) {
  const n = $("notice");
  n.textContent = text;
  n.hidden = !text;
}

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

// -- rendering -------------------------------------------------------------------------
function button(label, onClick, cls = "") {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.className = cls;
  b.addEventListener("click", onClick);
  return b;
}

async function copyText(text, btn) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    const area = Object.assign(document.createElement("textarea"), { value: text });
    document.body.appendChild(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  const was = btn.textContent;
  btn.textContent = "copied";
  setTimeout(() => { btn.textContent = was; }, 1200);
}

function statsText(msg) {
  const st = msg.stats;
  if (!st) return msg.pending ? "waiting for the first token…" : "";
  const parts = [];
  if (st.tokens !== null) parts.push(`${st.tokens} tokens`);
  if (st.tps !== null) parts.push(`${st.live ? "~" : ""}${st.tps.toFixed(1)} tok/s`);
  if (st.ttft_ms !== null) parts.push(`first token ${Math.round(st.ttft_ms)} ms`);
  if (st.finish_reason) parts.push(st.finish_reason === "abort" ? "stopped" : st.finish_reason);
  return parts.join(" · ");
}

function fillUser(el, conv, msg) {
  if (editing === msg.id) {
    const area = Object.assign(document.createElement("textarea"), { value: msg.content, rows: 3, className: "edit" });
    const save = button("Save & send", () => resendEdited(conv, msg, area.value), "primary");
    el.append(area, actions(button("Cancel", () => { editing = null; renderLog(); }), save));
    setTimeout(() => area.focus());
    return;
  }
  const body = Object.assign(document.createElement("div"), { className: "body", textContent: msg.content });
  el.append(body, actions(
    ...branchNav(conv, msg),
    button("Edit", () => { if (!active) { editing = msg.id; renderLog(); } }, "edit-btn"),
    button("Copy", (ev) => copyText(msg.content, ev.currentTarget), "copy-btn"),
  ));
}

function fillAssistant(el, conv, msg) {
  if (msg.choices && msg.choices.length > 1) {
    const tabs = Object.assign(document.createElement("div"), { className: "choices" });
    msg.choices.forEach((_, i) => {
      const b = button(`${i + 1}`, () => { msg.chosen = i; msg.content = msg.choices[i] || ""; store.save(); renderLog(); });
      b.classList.toggle("chosen", i === (msg.chosen || 0));
      b.title = "show sample " + (i + 1) + " (the one shown goes into the history)";
      tabs.appendChild(b);
    });
    el.appendChild(tabs);
  }
  const body = Object.assign(document.createElement("div"), { className: "body markdown" });
  body.innerHTML = renderMarkdown(msg.content || "");
  enhance(body);
  for (const pre of body.querySelectorAll("pre")) {
    pre.prepend(button("copy", (ev) => copyText(pre.querySelector("code").textContent, ev.currentTarget), "code-copy"));
  }
  el.appendChild(body);
  if (msg.error) el.appendChild(Object.assign(document.createElement("div"), { className: "error-text", textContent: msg.error }));
  const stats = Object.assign(document.createElement("span"), { className: "stats", textContent: statsText(msg) });
  if (msg.stats && msg.stats.tps !== null && !msg.stats.live) stats.dataset.tps = msg.stats.tps.toFixed(2);
  const last = conv.messages[conv.messages.length - 1] === msg;
  const buttons = [stats, ...branchNav(conv, msg)];
  if (!msg.pending) {
    if (msg.content) buttons.push(button("Copy", (ev) => copyText(msg.content, ev.currentTarget), "copy-btn"));
    if (last && msg.stats && msg.stats.finish_reason === "length" && !msg.choices) {
      buttons.push(button("Continue", () => continueReply(conv, msg), "continue-btn"));
    }
    buttons.push(button(msg.failed ? "Retry" : "Regenerate", () => regenerate(conv, msg), "regen-btn"));
  }
  el.appendChild(actions(...buttons));
}

// ‹ 2/3 ›: the versions of a message kept by Regenerate and Edit.
function branchNav(conv, msg) {
  const all = siblings(conv, msg);
  if (all.length < 2) return [];
  const i = all.indexOf(msg);
  const go = (j) => { if (!active && all[j]) { editing = null; showBranch(conv, all[j]); store.save(); renderLog(); } };
  const prev = button("‹", () => go(i - 1), "branch-prev");
  const next = button("›", () => go(i + 1), "branch-next");
  prev.disabled = i === 0;
  next.disabled = i === all.length - 1;
  prev.title = next.title = "other versions of this message (kept by Regenerate and Edit)";
  const label = Object.assign(document.createElement("span"), { className: "branch-label", textContent: `${i + 1}/${all.length}` });
  const nav = Object.assign(document.createElement("span"), { className: "branches" });
  nav.append(prev, label, next);
  return [nav];
}

function actions(...children) {
  const div = Object.assign(document.createElement("div"), { className: "actions" });
  div.append(...children);
  return div;
}

function messageEl(conv, msg) {
  const el = document.createElement("div");
  el.className = `msg ${msg.role}` + (msg.failed ? " failed" : "") + (msg.pending ? " pending" : "");
  el.dataset.id = msg.id;
  (msg.role === "user" ? fillUser : fillAssistant)(el, conv, msg);
  return el;
}

function renderLog() {
  const conv = store.current, log = $("log");
  const stick = log.scrollHeight - log.scrollTop - log.clientHeight < 80;
  log.replaceChildren(...conv.messages.map((m) => messageEl(conv, m)));
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
  old.replaceWith(messageEl(conv, msg));
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
  // HTTP requests name themselves, so the KV view can mark the reply's own block table.
  const rid = mode === "socket" ? null : `web-${kv.token}-${newId()}`;
  if (rid) params.request_id = rid;
  kv.follow(rid ? "chatcmpl-" + rid : null);
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

// -- export / import -------------------------------------------------------------------
function exportAll() {
  const blob = new Blob([store.exportJSON()], { type: "application/json" });
  const a = Object.assign(document.createElement("a"), {
    href: URL.createObjectURL(blob), download: `streamkv-chats-${new Date().toISOString().slice(0, 10)}.json` });
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 10_000);
}

async function importFile(file) {
  try {
    const n = store.importJSON(await file.text());
    notice(`imported ${n} conversation${n > 1 ? "s" : ""} from ${file.name}`);
  } catch (e) {
    notice(`could not import ${file.name}: ${e.message}`);
  }
  renderLog();
}

// -- attachments -----------------------------------------------------------------------
// A text file goes into the message as a fenced block (the model reads text only).
const MAX_ATTACH_BYTES = 200_000;
async function attach(file) {
  if (file.size > MAX_ATTACH_BYTES) return notice(`${file.name} is ${Math.round(file.size / 1000)} kB: attach at most ${MAX_ATTACH_BYTES / 1000} kB of text`);
  const text = await file.text();
  if (text.includes("\u0000")) return notice(`${file.name} is not a text file`);
  const fence = text.includes("```") ? "````" : "```";
  const input = $("input");
  input.value = `${input.value}${input.value ? "\n\n" : ""}${file.name}:\n${fence}\n${text.replace(/\n$/, "")}\n${fence}\n`;
  notice("");
  input.focus();
}

// -- theme -----------------------------------------------------------------------------
// auto follows the OS (prefers-color-scheme); the button cycles auto → dark → light.
const THEMES = ["auto", "dark", "light"];
function setTheme(theme) {
  document.documentElement.dataset.theme = theme;
  localStorage.setItem("streamkv.theme", theme);
  $("toggle-theme").textContent = { auto: "◐ auto", dark: "☾ dark", light: "☀ light" }[theme];
  $("toggle-theme").title = `colour theme: ${theme} (click to change)`;
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
$("export").addEventListener("click", exportAll);
$("attach").addEventListener("click", () => $("attach-file").click());
$("attach-file").addEventListener("change", (ev) => { const f = ev.target.files[0]; ev.target.value = ""; if (f) attach(f); });
$("import").addEventListener("click", () => $("import-file").click());
$("import-file").addEventListener("change", (ev) => { const f = ev.target.files[0]; ev.target.value = ""; if (f) importFile(f); });
$("toggle-theme").addEventListener("click", () => {
  const now = document.documentElement.dataset.theme || "auto";
  setTheme(THEMES[(THEMES.indexOf(now) + 1) % THEMES.length]);
});
setTheme(THEMES.includes(localStorage.getItem("streamkv.theme")) ? localStorage.getItem("streamkv.theme") : "auto");

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
