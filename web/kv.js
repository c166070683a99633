// The live view of the paged KV cache (the paper's Figures 6 and 7), laid out to teach:
// a short explanation, each running request's block table (logical block i -> physical
// block), the events with the blocks they touched, the last minute on a time axis, and the
// physical pool as a compact overview (kv_pool.js). Fed by GET /v1/kv/stream (server-sent
// events, docs/api.md); connected only while shown.
"use strict";

import { authHeaders } from "./transport.js";
import { NAMES, PoolView } from "./kv_pool.js";
import { Timeline } from "./kv_timeline.js";
import { diffSnapshots } from "./kv_diff.js";

const pct = (x) => (100 * x).toFixed(1) + " %";
const HEADLINE = [
  ["kv_usage", "KV usage", (h) => pct(h.kv_usage)],
  ["used_blocks", "blocks used", (h, s) => `${h.used_blocks} / ${s.device.num_blocks}`],
  ["shared_blocks", "shared", (h) => String(h.shared_blocks)],
  ["cached_blocks", "cached, free", (h) => String(h.cached_blocks)],
  ["waste", "waste", (h) => pct(h.waste)],
  ["sharing_savings", "sharing saves", (h) => pct(h.sharing_savings)],
  ["prefix_cache_hit_rate", "prefix hits", (h) => pct(h.prefix_cache_hit_rate)],
  ["queues", "run / wait / swap", (h) => `${h.running} / ${h.waiting} / ${h.swapped}`],
];
const MARK_MS = 4000; // how long a copied or reused block stays outlined

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

// Always on screen: one summary line; the full lines below it are open except on a phone.
function explainer(blockSize) {
  const box = el("details", "kv-explain");
  box.open = !matchMedia("(max-width: 760px)").matches;
  box.appendChild(el("summary", "", `A block holds the K/V of ${blockSize} tokens · a block table maps a sequence's ` +
    "logical blocks to physical ones · orange = shared (×ref count) · copy-on-write"));
  const lines = [
    ["Block", ` = the keys and values (K/V) of ${blockSize} tokens. A request's cache grows one block at a time, so at most ${blockSize - 1} slots sit empty.`],
    ["Block table", " = one row per sequence: logical block 0, 1, 2… (its order in the text) → the physical block that holds it, anywhere in the pool, like a page table."],
    ["Orange", " = shared: several tables point at the same block (×N is its ref count), e.g. n samples of one prompt or a cached prefix."],
    ["Copy-on-write", " = before a sequence writes into a shared block it gets its own copy; outlined blocks were just copied or reused."],
    ["Prefix cache", " = a prompt that starts like an earlier one maps the blocks already computed; a block is shared only once computed."],
  ];
  for (const [term, text] of lines) {
    const p = el("p");
    p.append(el("b", "", term), document.createTextNode(text));
    box.appendChild(p);
  }
  return box;
}

// The secret this page opens the stream with: the server shows the real ids and tables of
// the requests whose id holds it (the page's own) and anonymous labels for everyone else's.
function newToken() {
  const bytes = crypto.getRandomValues(new Uint8Array(18));
  return btoa(String.fromCharCode(...bytes)).replace(/\+/g, "-").replace(/\//g, "_");
}

export class KVView {
  constructor(root, apiKey) {
    this.root = root;
    this.apiKey = apiKey;
    this.token = newToken();
    this.abort = null;
    this.attempt = 0;
    this.timer = null;
    this.last = null;
    this.events = [];
    this.marks = new Map(); // physical block -> {cls, until}
    this.mine = null; // the engine request id of the reply on screen
    this.build();
  }

  build() {
    this.status = el("p", "kv-status", "not connected");
    this.explain = explainer(16);
    this.headline = el("div", "kv-headline");
    this.stats = {};
    for (const [key, label] of HEADLINE) {
      const box = el("div", "kv-stat");
      box.dataset.key = key;
      const value = el("b", "", "–");
      box.append(value, el("span", "", label));
      this.stats[key] = value;
      this.headline.appendChild(box);
    }
    this.tables = el("div", "kv-tables");
    this.eventList = el("ol", "kv-events");
    this.timeline = new Timeline();
    this.legend = el("div", "kv-legend");
    this.device = new PoolView("Physical block pool", "kv-device");
    this.cpu = new PoolView("CPU swap space", "kv-cpu");
    this.cpuNote = el("p", "kv-caption", "Preempting a request by swapping moves its blocks here; they come back when it resumes.");
    this.cpu.box.appendChild(this.cpuNote);
    this.root.replaceChildren(
      this.status, this.explain,
      el("h3", "", "Block tables (logical → physical)"), this.tables,
      el("h3", "", "Events"), this.eventList,
      this.headline, this.timeline.box,
      this.legend, this.device.box, this.cpu.box);
    this.device.grid.addEventListener("mouseover", (ev) => this.device.describe(ev.target, this.refCounts(), this.owners()));
    // Pointing at an event lights up the blocks it names, in the tables and in the pool.
    this.eventList.addEventListener("mouseover", (ev) => this.spotlight(ev.target.closest("li")));
    this.eventList.addEventListener("mouseleave", () => this.spotlight(null));
    this.cpu.grid.addEventListener("mouseover", (ev) => this.cpu.describe(ev.target, {}, new Map()));
  }

  // -- the reply on screen --------------------------------------------------------------
  // Replies name themselves with this.token in their request id (app.js): the server marks
  // their rows own, and the id of the one on screen picks it out among them.
  follow(id) {
    this.mine = id;
  }

  isMine(req) {
    return req.own === true || req.request_id === this.mine;
  }

  // -- the stream ----------------------------------------------------------------------
  start() {
    if (this.abort) return;
    const abort = (this.abort = new AbortController());
    this.setStatus("connecting…");
    this.read(abort).catch((e) => {
      if (abort.signal.aborted && this.abort !== abort) return; // stopped on purpose
      this.abort = null;
      if (e.final) return this.setStatus(e.message, "off"); // the server has the view off: retrying will not help
      const delay = Math.min(15000, 500 * 2 ** this.attempt++);
      this.setStatus(`disconnected (${e.message}), retrying in ${(delay / 1000).toFixed(1)} s`);
      this.timer = setTimeout(() => this.start(), delay);
    });
    this.tick = setInterval(() => this.timeline.draw(), 1000);
  }

  stop() {
    clearTimeout(this.timer);
    clearInterval(this.tick);
    const abort = this.abort;
    this.abort = null;
    if (abort) abort.abort();
    this.setStatus("paused (hidden)");
  }

  async read(abort) {
    const resp = await fetch(`/v1/kv/stream?token=${this.token}`, { signal: abort.signal, headers: authHeaders(this.apiKey()) });
    if (resp.status === 404) {
      const body = await resp.json().catch(() => ({}));
      throw Object.assign(new Error(body.error?.message || "this server has no KV-cache view"), { final: true });
    }
    if (!resp.ok) throw new Error(resp.status === 401 ? "HTTP 401: the server needs an API key (Settings)" : `HTTP ${resp.status}`);
    this.attempt = 0;
    this.setStatus("live");
    const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) throw new Error("the stream ended");
      buf += value.replace(/\r\n/g, "\n");
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
        if (data) this.show(JSON.parse(data));
      }
    }
  }

  setStatus(text, state = text.split(" ")[0]) { this.status.textContent = text; this.root.dataset.state = state; }

  // -- drawing -------------------------------------------------------------------------
  refCounts() { return this.last ? this.last.ref_counts : {}; }

  // physical block -> ["seq 3 (logical 0)", ...] over the tables on screen
  owners() {
    const out = new Map();
    for (const r of this.last ? this.last.requests : []) {
      for (const s of r.seqs) {
        if (s.status === "swapped") continue;
        s.table.forEach((b, i) => { if (!out.has(b)) out.set(b, []); out.get(b).push(`seq ${s.seq_id} (logical ${i})`); });
      }
    }
    return out;
  }

  show(snap, now = Date.now()) {
    const h = snap.headline;
    for (const [key, , fmt] of HEADLINE) {
      this.stats[key].textContent = fmt(h, snap);
      this.stats[key].parentElement.dataset.value = key in h ? String(h[key]) : "";
    }
    if (snap.block_size && this.blockSize !== snap.block_size) {
      this.blockSize = snap.block_size;
      const fresh = explainer(snap.block_size);
      this.explain.replaceWith(fresh);
      this.explain = fresh;
    }
    this.root.dataset.seq = String(snap.seq);
    const found = this.last ? diffSnapshots(this.last, snap) : { events: [], marks: [] };
    for (const m of found.marks) this.marks.set(m.block, { cls: m.cls, until: now + MARK_MS });
    for (const [b, m] of this.marks) if (m.until < now) this.marks.delete(b);
    this.drawLegend(snap);
    this.device.marks = new Map([...this.marks].map(([b, m]) => [b, m.cls]));
    for (const b of this.spotted || []) this.device.marks.set(b, "spot");
    this.device.mine = this.mineBlocks(snap);
    this.device.draw(snap.device, `${snap.block_size} tokens each`);
    // No swap pool (the default on a CPU, where the device pool is RAM already): said, not hidden.
    this.cpu.grid.hidden = this.cpu.zoom.hidden = !snap.cpu.num_blocks;
    if (snap.cpu.num_blocks) {
      this.cpu.draw(snap.cpu, "CPU RAM");
      this.cpuNote.textContent = "Preempting a request by swapping moves its blocks here; they come back when it resumes.";
    } else {
      this.cpu.caption.textContent = "none: a preempted request gives its blocks back and is recomputed later";
      this.cpuNote.textContent = "Start the server with --swap-space GIB (or --num-swap-blocks N) to watch requests swap out to CPU RAM and back.";
    }
    this.drawTables(snap);
    this.timeline.add(snap, this.last && this.last.counters, now);
    this.noteEvents(found.events, now);
    this.last = snap;
  }

  mineBlocks(snap) {
    const out = new Set();
    for (const r of snap.requests) {
      if (!this.isMine(r)) continue;
      for (const s of r.seqs) if (s.status !== "swapped") s.table.forEach((b) => out.add(b));
    }
    return out;
  }

  drawLegend(snap) {
    if (this.legend.childElementCount) return;
    for (const [letter, name] of Object.entries(snap.legend)) {
      const item = el("span", "kv-key");
      item.append(el("i", `cell st-${NAMES[letter] || "other"}`), document.createTextNode(name));
      this.legend.appendChild(item);
    }
    for (const [cls, name] of [["cow", "just copied (copy-on-write)"], ["hit", "reused from the prefix cache"], ["mine", "the reply on screen"]]) {
      const item = el("span", "kv-key");
      item.append(el("i", `cell st-used ${cls}`), document.createTextNode(name));
      this.legend.appendChild(item);
    }
  }

  blockEl(block, state, refCount) {
    const b = el("span", `blk st-${state}`, String(block));
    b.dataset.block = String(block);
    const mark = this.marks.get(block);
    if (mark && state !== "swapped") b.classList.add(mark.cls);
    if (this.spotted && this.spotted.includes(block) && state !== "swapped") b.classList.add("spot");
    if (refCount) {
      b.appendChild(el("sup", "rc", "×" + refCount));
      b.title = `physical block ${block}, shared: ref count ${refCount}`;
    }
    return b;
  }

  drawTables(snap) {
    const per = snap.device.blocks_per_cell, cells = snap.device.cells, rcs = snap.ref_counts;
    const rows = snap.requests.map((req) => {
      const mine = this.isMine(req);
      const box = el("div", "kv-request" + (mine ? " mine" : ""));
      box.dataset.requestId = req.request_id;
      const label = el("div", "kv-req-id", `${req.request_id.slice(0, 22)} · ${req.seqs.length} seq${req.seqs.length > 1 ? "s" : ""}`);
      if (mine) label.prepend(el("b", "kv-mine-tag", req.request_id === this.mine ? "your reply · " : "your other request · "));
      box.appendChild(label);
      for (const s of req.seqs) {
        const row = el("div", "kv-row" + (s.status === "swapped" ? " swapped" : ""));
        row.dataset.seq = String(s.seq_id);
        const where = s.status === "swapped" ? " · swapped to CPU" : "";
        row.appendChild(el("span", "kv-row-label", `seq ${s.seq_id} · ${s.num_tokens} tok${where}`));
        s.table.forEach((block, i) => {
          const swapped = s.status === "swapped";
          const state = swapped ? "swapped" : NAMES[cells[Math.floor(block / per)]] || "used";
          const b = this.blockEl(block, state, swapped ? 0 : rcs[String(block)]);
          if (!b.title) b.title = `logical block ${i} → ${swapped ? "CPU" : "physical"} block ${block}`;
          row.appendChild(b);
        });
        if (s.num_blocks > s.table.length) row.appendChild(el("span", "kv-more", `+${s.num_blocks - s.table.length}`));
        box.appendChild(row);
      }
      return box;
    });
    if (snap.num_requests_left_out) rows.push(el("p", "kv-more", `+ ${snap.num_requests_left_out} more requests`));
    if (!rows.length) rows.push(el("p", "kv-idle", "no request holds blocks: send a message and watch its table grow"));
    this.tables.replaceChildren(...rows);
  }

  spotlight(li) {
    const blocks = new Set(li && li.dataset.blocks ? li.dataset.blocks.split(",") : []);
    for (const b of this.tables.querySelectorAll(".blk")) b.classList.toggle("spot", blocks.has(b.dataset.block));
    const cells = this.device.grid.children;
    if (this.device.per === 1) {
      for (const b of this.spotted || []) cells[b]?.classList.remove("spot");
      for (const b of blocks) cells[Number(b)]?.classList.add("spot");
    }
    this.spotted = [...blocks].map(Number);
  }

  noteEvents(found, now) {
    const time = new Date(now).toLocaleTimeString();
    for (const e of found) this.events.unshift({ ...e, time });
    this.events.length = Math.min(this.events.length, 12);
    this.eventList.replaceChildren(...this.events.map((e) => {
      const li = el("li", "ev-" + e.key, `${e.time} ${e.text}`);
      if (e.blocks && e.blocks.length) li.dataset.blocks = e.blocks.join(",");
      return li;
    }));
  }
}
