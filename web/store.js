// Conversations and settings kept in the browser's localStorage (nothing leaves the page).
// A conversation: {id, title, created, messages: [{id, role, content, failed?, error?,
// choices?, chosen?, stats?, pending?}]}.
"use strict";

const CONVS = "streamkv.conversations.v1";
const CURRENT = "streamkv.current.v1";
const SETTINGS = "streamkv.settings.v1";
const MAX_CONVERSATIONS = 50;

export const DEFAULT_SETTINGS = {
  system: "", max_tokens: 256, temperature: 0.7, top_p: 1, top_k: "", seed: "", n: 1, beam_width: 0,
};

function read(key, fallback) {
  try {
    const raw = localStorage.getItem(key);
    return raw === null ? fallback : JSON.parse(raw);
  } catch {
    return fallback; // corrupt or unavailable storage: start afresh rather than break the page
  }
}

function write(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch (e) {
    console.warn("could not save to localStorage:", e);
  }
}

export const newId = () => Date.now().toString(36) + Math.random().toString(36).slice(2, 8);

export class Store {
  constructor() {
    this.conversations = read(CONVS, []).filter((c) => c && Array.isArray(c.messages));
    // A reply that was streaming when the page went away will never finish: it is marked
    // failed so it stays out of the next request's history.
    for (const c of this.conversations) {
      for (const m of c.messages) {
        if (m.pending) {
          m.pending = false;
          markFailed(c, m, "interrupted: the page was closed or reloaded while this streamed");
        }
      }
    }
    this.currentId = read(CURRENT, null);
    if (!this.get(this.currentId)) this.currentId = this.conversations[0]?.id ?? this.create().id;
    this.settings = { ...DEFAULT_SETTINGS, ...read(SETTINGS, {}) };
  }

  get(id) { return this.conversations.find((c) => c.id === id) || null; }
  get current() { return this.get(this.currentId); }

  create() {
    const conv = { id: newId(), title: "New chat", created: Date.now(), messages: [] };
    this.conversations.unshift(conv);
    this.conversations.length = Math.min(this.conversations.length, MAX_CONVERSATIONS);
    this.currentId = conv.id;
    this.save();
    return conv;
  }

  remove(id) {
    this.conversations = this.conversations.filter((c) => c.id !== id);
    if (this.currentId === id) this.currentId = this.conversations[0]?.id ?? this.create().id;
    this.save();
  }

  select(id) {
    if (this.get(id)) { this.currentId = id; write(CURRENT, id); }
  }

  save() {
    write(CONVS, this.conversations);
    write(CURRENT, this.currentId);
  }

  saveSettings() { write(SETTINGS, this.settings); }
}

// A failed reply fails its turn: the user message it answered goes out of the history too,
// or every later request would carry the same bad prompt and fail the same way.
export function markFailed(conv, msg, error) {
  msg.failed = true;
  msg.error = error;
  const i = conv.messages.indexOf(msg);
  const prev = conv.messages[i - 1];
  if (prev && prev.role === "user") prev.failed = true;
}

// The messages a new request sends: the system prompt, then every turn that did not fail.
export function history(conv, system, upTo = conv.messages.length) {
  const out = system && system.trim() ? [{ role: "system", content: system }] : [];
  for (const m of conv.messages.slice(0, upTo)) {
    if (m.failed || m.pending || !m.content) continue;
    out.push({ role: m.role, content: m.content });
  }
  return out;
}
