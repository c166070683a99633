// The live view of the paged KV cache (the paper's Figures 6 and 7): the physical block pool
// as a grid, each running request's block table as a row of the physical blocks it maps to,
// copy-on-write / preemption / swap events as they happen, and the headline numbers.
// Fed by GET /v1/kv/stream (server-sent events, docs/api.md); connected only while shown.
"use strict";

import { authHeaders } from "./transport.js";

const NAMES = { ".": "free", c: "cached", u: "used", s: "shared", p: "pinned" };
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
const EVENTS = [
  ["cow_copies", (d) => `copy-on-write: ${d} block${d > 1 ? "s" : ""} copied before a write`],
  ["preemptions", (d) => `preempted ${d} request${d > 1 ? "s" : ""} (out of blocks)`],
  ["swapped_out_blocks", (d) => `swapped ${d} block${d > 1 ? "s" : ""} out to CPU`],
  ["swapped_in_blocks", (d) => `swapped ${d} block${d > 1 ? "s" : ""} back in`],
  ["evictions", (d) => `evicted ${d} cached block${d > 1 ? "s" : ""}`],
  ["prefix_cache_hits", (d) => `prefix cache: ${d} prompt tokens reused`],
];

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

export class KVView {
  constructor(root, apiKey) {
    this.root = root;
    this.apiKey = apiKey;
    this.abort = null;
    this.attempt = 0;
    this.timer = null;
    this.last = null;
    this.events = [];
    this.build();
  }

  build() {
    this.status = el("p", "kv-status", "not connected");
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
    this.legend = el("div", "kv-legend");
    this.grid = el("div", "kv-grid");
    this.grid.setAttribute("role", "img");
    this.cpuTitle = el("h3", "", "CPU swap space");
    this.cpuGrid = el("div", "kv-grid kv-cpu");
    this.tables = el("div", "kv-tables");
    this.eventList = el("ol", "kv-events");
    this.root.replaceChildren(
      this.status, this.headline,
      el("h3", "", "Physical KV blocks"), this.legend, this.grid,
      this.cpuTitle, this.cpuGrid,
      el("h3", "", "Block tables (logical → physical)"), this.tables,
      el("h3", "", "Events"), this.eventList);
    this.grid.addEventListener("mouseover", (ev) => this.explain(ev));
  }

  // -- the stream ----------------------------------------------------------------------
  start() {
    if (this.abort) return;
    const abort = (this.abort = new AbortController());
    this.setStatus("connecting…");
    this.read(abort).catch((e) => {
      if (abort.signal.aborted && this.abort !== abort) return; // stopped on purpose
      this.abort = null;
      const delay = Math.min(15000, 500 * 2 ** this.attempt++);
      this.setStatus(`disconnected (${e.message}), retrying in ${(delay / 1000).toFixed(1)} s`);
      this.timer = setTimeout(() => this.start(), delay);
    });
  }

  stop() {
    clearTimeout(this.timer);
    const abort = this.abort;
    this.abort = null;
    if (abort) abort.abort();
    this.setStatus("paused (hidden)");
  }

  async read(abort) {
    const resp = await fetch("/v1/kv/stream", { signal: abort.signal, headers: authHeaders(this.apiKey()) });
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
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

  setStatus(text) { this.status.textContent = text; this.root.dataset.state = text.split(" ")[0]; }

  // -- drawing -------------------------------------------------------------------------
  show(snap) {
    const h = snap.headline;
    for (const [key, , fmt] of HEADLINE) {
      this.stats[key].textContent = fmt(h, snap);
      this.stats[key].parentElement.dataset.value = key in h ? String(h[key]) : "";
    }
    this.root.dataset.seq = String(snap.seq);
    this.drawLegend(snap);
    this.drawGrid(this.grid, snap.device, snap.ref_counts);
    this.cpuTitle.hidden = this.cpuGrid.hidden = !snap.cpu.num_blocks;
    this.drawGrid(this.cpuGrid, snap.cpu, {});
    this.drawTables(snap);
    this.noteEvents(snap);
    this.last = snap;
  }

  drawLegend(snap) {
    if (this.legend.childElementCount) return;
    for (const [letter, name] of Object.entries(snap.legend)) {
      const item = el("span", "kv-key");
      item.append(el("i", `cell st-${NAMES[letter] || "other"}`), document.createTextNode(name));
      this.legend.appendChild(item);
    }
  }

  drawGrid(grid, pool, refCounts) {
    const cells = pool.cells;
    if (grid.childElementCount !== cells.length) {
      const frag = document.createDocumentFragment();
      for (let i = 0; i < cells.length; i++) frag.appendChild(el("i"));
      grid.replaceChildren(frag);
    }
    grid.dataset.perCell = String(pool.blocks_per_cell);
    const kids = grid.children;
    for (let i = 0; i < cells.length; i++) {
      const cls = "cell st-" + (NAMES[cells[i]] || "other");
      if (kids[i].className !== cls) kids[i].className = cls;
    }
    this.refCounts = refCounts;
  }

  explain(ev) {
    const i = Array.prototype.indexOf.call(this.grid.children, ev.target);
    if (i < 0 || !this.last) return;
    const per = this.last.device.blocks_per_cell;
    const state = NAMES[this.last.device.cells[i]] || "?";
    const rc = per === 1 && this.refCounts[String(i)] ? `, ref count ${this.refCounts[String(i)]}` : "";
    ev.target.title = per === 1 ? `block ${i}: ${state}${rc}` : `blocks ${i * per}–${i * per + per - 1}: ${state}`;
  }

  drawTables(snap) {
    const per = snap.device.blocks_per_cell, cells = snap.device.cells;
    const rows = snap.requests.map((req) => {
      const box = el("div", "kv-request");
      box.appendChild(el("div", "kv-req-id", `${req.request_id.slice(0, 22)} · ${req.seqs.length} seq${req.seqs.length > 1 ? "s" : ""}`));
      for (const s of req.seqs) {
        const row = el("div", "kv-row" + (s.status === "swapped" ? " swapped" : ""));
        row.appendChild(el("span", "kv-row-label", `seq ${s.seq_id} · ${s.num_tokens} tok`));
        s.table.forEach((block) => {
          const state = s.status === "swapped" ? "swapped" : NAMES[cells[Math.floor(block / per)]] || "used";
          const b = el("span", `blk st-${state}`, String(block));
          b.dataset.block = String(block);
          row.appendChild(b);
        });
        if (s.num_blocks > s.table.length) row.appendChild(el("span", "kv-more", `+${s.num_blocks - s.table.length}`));
        box.appendChild(row);
      }
      return box;
    });
    if (snap.num_requests_left_out) rows.push(el("p", "kv-more", `+ ${snap.num_requests_left_out} more requests`));
    if (!rows.length) rows.push(el("p", "kv-idle", "no request holds blocks"));
    this.tables.replaceChildren(...rows);
  }

  noteEvents(snap) {
    const prev = this.last && this.last.counters;
    if (!prev) return;
    const time = new Date().toLocaleTimeString();
    for (const [key, text] of EVENTS) {
      const d = snap.counters[key] - prev[key];
      if (d > 0) this.events.unshift({ key, text: `${time} ${text(d)}` });
    }
    this.events.length = Math.min(this.events.length, 12);
    this.eventList.replaceChildren(...this.events.map((e) => {
      const li = el("li", "ev-" + e.key, e.text);
      return li;
    }));
  }
}
