// How a reply reaches the page. One sample streams over the WebSocket chat (/v1/chat/ws,
// docs/api.md), which reconnects on its own with backoff. n > 1 streams over HTTP SSE
// (/v1/chat/completions), and beam search, which the API only answers whole, is one
// HTTP request: the WebSocket protocol has no n, best_of or beams.
//
// A generation is driven through callbacks: onDelta(index, text), onDone({finish_reason,
// usage}), onError(message). start*() returns a stop() function. onStatus(state, text,
// retryAt) says how the socket stands; retryAt is when the next attempt is due.
"use strict";

const sameOrigin = (path, ws = false) =>
  (ws ? (location.protocol === "https:" ? "wss://" : "ws://") : location.protocol + "//") + location.host + path;

export function authHeaders(key) {
  return key ? { Authorization: "Bearer " + key } : {};
}

export class ChatSocket {
  constructor({ path = "/v1/chat/ws", apiKey = () => "", onStatus = () => {} } = {}) {
    Object.assign(this, { path, apiKey, onStatus });
    this.ws = null;
    this.gens = new Map(); // id -> callbacks
    this.nextId = 1;
    this.attempt = 0;
    this.timer = null;
    this.waiters = [];
  }

  connect() {
    clearTimeout(this.timer);
    const protocols = ["streamkv"];
    const key = this.apiKey();
    if (key) protocols.push("bearer." + key);
    const ws = new WebSocket(sameOrigin(this.path, true), protocols);
    this.ws = ws;
    this.onStatus("connecting", "connecting…");
    ws.onopen = () => {
      this.attempt = 0;
      this.onStatus("connected", "connected");
      for (const w of this.waiters.splice(0)) w.resolve();
    };
    ws.onmessage = (ev) => this.dispatch(ev.data);
    ws.onclose = () => {
      if (this.ws !== ws) return; // replaced by a deliberate reconnect
      this.ws = null;
      for (const [id, gen] of this.gens) gen.onError("the connection to the server was lost");
      this.gens.clear();
      // Exponential backoff with jitter, so a restarted server is not hit by every tab at once.
      const delay = Math.min(15000, 500 * 2 ** this.attempt++) * (0.75 + Math.random() * 0.5);
      this.retryAt = Date.now() + delay;
      this.onStatus("disconnected", "disconnected", this.retryAt);
      this.timer = setTimeout(() => this.connect(), delay);
    };
  }

  get connected() { return !!this.ws && this.ws.readyState === WebSocket.OPEN; }

  reconnect() {
    const old = this.ws;
    this.ws = null;
    if (old) old.close();
    this.attempt = 0;
    this.connect();
  }

  whenOpen(timeoutMs = 8000) {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) return Promise.resolve();
    if (!this.ws) this.connect();
    return new Promise((resolve, reject) => {
      const w = { resolve: () => { clearTimeout(t); resolve(); } };
      const t = setTimeout(() => {
        this.waiters = this.waiters.filter((x) => x !== w);
        reject(new Error("not connected to the server (still retrying)"));
      }, timeoutMs);
      this.waiters.push(w);
    });
  }

  dispatch(raw) {
    let msg;
    try { msg = JSON.parse(raw); } catch { return; }
    const gen = this.gens.get(msg.id);
    if (!gen) return;
    if (msg.type === "delta") gen.onDelta(0, msg.text);
    else if (msg.type === "done") { this.gens.delete(msg.id); gen.onDone(msg); }
    else if (msg.type === "error") {
      this.gens.delete(msg.id);
      gen.onError((msg.error && msg.error.message) || "the server reported an error");
    }
  }

  start(messages, params, cb) {
    const id = "g" + this.nextId++;
    let stopped = false;
    this.whenOpen().then(() => {
      if (stopped) return cb.onDone({ finish_reason: "abort", usage: null });
      this.gens.set(id, cb);
      this.ws.send(JSON.stringify({ type: "chat", id, messages, params }));
    }, (e) => cb.onError(e.message));
    return () => {
      stopped = true;
      if (this.gens.has(id) && this.ws) this.ws.send(JSON.stringify({ type: "cancel", id }));
    };
  }
}

async function errorMessage(resp) {
  try {
    const body = await resp.json();
    return (body.error && body.error.message) || `HTTP ${resp.status}`;
  } catch {
    return `HTTP ${resp.status}`;
  }
}

// Several samples, streamed (SSE over fetch: EventSource can neither POST nor send a key).
export function startHttpStream(messages, params, apiKey, cb) {
  const abort = new AbortController();
  let finished = false;
  const finish = (f) => { if (!finished) { finished = true; f(); } };
  (async () => {
    const resp = await fetch(sameOrigin("/v1/chat/completions"), {
      method: "POST", signal: abort.signal,
      headers: { "Content-Type": "application/json", ...authHeaders(apiKey) },
      body: JSON.stringify({ ...params, messages, stream: true, stream_options: { include_usage: true } }),
    });
    if (!resp.ok) return finish(async () => cb.onError(await errorMessage(resp)));
    const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = "", usage = null, reason = null;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += value;
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("");
        if (!data || data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) return finish(() => cb.onError(chunk.error.message));
        if (chunk.usage) usage = chunk.usage;
        for (const c of chunk.choices || []) {
          if (c.delta && c.delta.content) cb.onDelta(c.index, c.delta.content);
          if (c.finish_reason) reason = c.finish_reason;
        }
      }
    }
    finish(() => cb.onDone({ finish_reason: reason, usage }));
  })().catch((e) => {
    if (e.name === "AbortError") finish(() => cb.onDone({ finish_reason: "abort", usage: null }));
    else finish(() => cb.onError(e.message));
  });
  return () => abort.abort();
}

// Beam search: the server answers it whole, so the reply arrives at once.
export function startHttpWhole(messages, params, apiKey, cb) {
  const abort = new AbortController();
  (async () => {
    const resp = await fetch(sameOrigin("/v1/chat/completions"), {
      method: "POST", signal: abort.signal,
      headers: { "Content-Type": "application/json", ...authHeaders(apiKey) },
      body: JSON.stringify({ ...params, messages }),
    });
    if (!resp.ok) return cb.onError(await errorMessage(resp));
    const body = await resp.json();
    for (const c of body.choices) cb.onDelta(c.index, c.message.content || "");
    cb.onDone({ finish_reason: body.choices[0]?.finish_reason, usage: body.usage });
  })().catch((e) => {
    if (e.name === "AbortError") cb.onDone({ finish_reason: "abort", usage: null });
    else cb.onError(e.message);
  });
  return () => abort.abort();
}
