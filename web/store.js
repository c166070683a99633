// Conversations and settings kept in the browser's localStorage (nothing leaves the page).
//
// A conversation is a tree, so that Regenerate and Edit keep the old version as a branch
// (‹1/2›): {id, title, created, nodes: [{id, parent, role, content, failed?, error?,
// choices?, chosen?, stats?, pending?}], leaf}. The messages on screen are the path from
// the root to `leaf` (conv.messages, rebuilt after every change of path). Conversations
// saved by older pages (a flat `messages` list) are read as a tree with no branches.
"use strict";

const CONVS = "streamkv.conversations.v1";
const CURRENT = "streamkv.current.v1";
const SETTINGS = "streamkv.settings.v1";

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

export const newId = () => Date.now().toString(36) + Math.random().toString(36).slice(2, 8);

// A conversation read from storage or an imported file, checked and made a tree.
export function adopt(raw) {
  if (!raw || typeof raw !== "object") return null;
  let nodes = Array.isArray(raw.nodes) ? raw.nodes : null;
  if (!nodes && Array.isArray(raw.messages)) {
    nodes = raw.messages.map((m, i) => ({ ...m, parent: i ? raw.messages[i - 1].id : null }));
  }
  if (!nodes) return null;
  nodes = nodes.filter((m) => m && typeof m.content === "string" && (m.role === "user" || m.role === "assistant"))
    .map((m) => ({ ...m, id: String(m.id || newId()) }));
  const ids = new Set(nodes.map((m) => m.id));
  for (const m of nodes) if (!ids.has(m.parent)) m.parent = null;
  const conv = { id: String(raw.id || newId()), title: String(raw.title || "Imported chat").slice(0, 80),
                 created: Number(raw.created) || Date.now(), nodes, leaf: ids.has(raw.leaf) ? raw.leaf : nodes.at(-1)?.id ?? null };
  walk(conv);
  return conv;
}

// conv.messages: the path from the root to the leaf.
export function walk(conv) {
  const byId = new Map(conv.nodes.map((m) => [m.id, m]));
  const path = [];
  for (let m = byId.get(conv.leaf); m; m = byId.get(m.parent)) path.unshift(m);
  conv.messages = path;
}

// The versions of `msg`: the nodes with its parent and role, oldest first.
export const siblings = (conv, msg) => conv.nodes.filter((m) => m.parent === msg.parent && m.role === msg.role);

// Show another version: the path follows it down, through the newest child at each step.
export function showBranch(conv, msg) {
  let leaf = msg;
  for (;;) {
    const kids = conv.nodes.filter((m) => m.parent === leaf.id);
    if (!kids.length) break;
    leaf = kids.find((k) => k.id === leaf.lastChild) || kids[kids.length - 1];
  }
  conv.leaf = leaf.id;
  walk(conv);
}

// Add `msg` as a child of `parent` (null: a first message) and show it.
export function append(conv, msg, parent = conv.leaf) {
  msg.id = msg.id || newId();
  msg.parent = parent;
  const p = conv.nodes.find((m) => m.id === parent);
  if (p) p.lastChild = msg.id;
  conv.nodes.push(msg);
  conv.leaf = msg.id;
  walk(conv);
  return msg;
}

export class Store {
  constructor() {
    this.conversations = read(CONVS, []).map(adopt).filter(Boolean);
    // A reply that was streaming when the page went away will never finish: it is marked
    // failed so it stays out of the next request's history.
    for (const c of this.conversations) {
      for (const m of c.nodes) {
        if (m.pending) {
          m.pending = false;
          markFailed(c, m, "interrupted: the page was closed or reloaded while this streamed");
        }
      }
    }
    this.currentId = read(CURRENT, null);
    if (!this.get(this.currentId)) this.currentId = this.conversations[0]?.id ?? this.create().id;
    this.settings = { ...DEFAULT_SETTINGS, ...read(SETTINGS, {}) };
    this.onError = () => {};
  }

  get(id) { return this.conversations.find((c) => c.id === id) || null; }
  get current() { return this.get(this.currentId); }

  create() {
    const conv = { id: newId(), title: "New chat", created: Date.now(), nodes: [], leaf: null, messages: [] };
    this.conversations.unshift(conv);
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
    if (this.get(id)) { this.currentId = id; this.write(CURRENT, id); }
  }

  // Imported conversations are added (never replacing one): the count added.
  importJSON(text) {
    const data = JSON.parse(text);
    const list = Array.isArray(data) ? data : Array.isArray(data.conversations) ? data.conversations : [data];
    const have = new Set(this.conversations.map((c) => c.id));
    const added = list.map(adopt).filter(Boolean).map((c) => (have.has(c.id) ? { ...c, id: newId() } : c));
    if (!added.length) throw new Error("no conversation found in this file");
    this.conversations.unshift(...added);
    this.currentId = added[0].id;
    this.save();
    return added.length;
  }

  exportJSON() {
    return JSON.stringify({ format: "streamkv-conversations", version: 2, exported: new Date().toISOString(),
                            conversations: this.conversations.map(stored) }, null, 1);
  }

  save() {
    this.write(CONVS, this.conversations.map(stored));
    this.write(CURRENT, this.currentId);
  }

  saveSettings() { this.write(SETTINGS, this.settings); }

  // Storage full (or off) is said on the page: nothing is dropped silently to make room.
  write(key, value) {
    try {
      localStorage.setItem(key, JSON.stringify(value));
      return true;
    } catch (e) {
      this.onError(`could not save in this browser's storage (${e.name}): export your conversations and delete some`);
      return false;
    }
  }
}

function stored(conv) {
  const { messages, ...rest } = conv; // the path is derived, not stored
  return rest;
}

// A failed reply fails its turn: the user message it answered goes out of the history too,
// or every later request would carry the same bad prompt and fail the same way.
export function markFailed(conv, msg, error) {
  msg.failed = true;
  msg.error = error;
  const prev = conv.nodes.find((m) => m.id === msg.parent);
  if (prev && prev.role === "user") prev.failed = true;
}

// The messages a new request sends: the system prompt, then every turn on screen that did
// not fail.
export function history(conv, system, upTo = conv.messages.length) {
  const out = system && system.trim() ? [{ role: "system", content: system }] : [];
  for (const m of conv.messages.slice(0, upTo)) {
    if (m.failed || m.pending || !m.content) continue;
    out.push({ role: m.role, content: m.content });
  }
  return out;
}
