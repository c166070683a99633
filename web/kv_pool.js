// The physical block pool as a compact overview: one small cell per block, or per N blocks
// when the pool would not fit a strip of MAX_HEIGHT pixels (a default CPU pool has 2,912
// blocks: 1-block cells of 4 px, about 130 px tall). The block tables above it are what
// teach; this strip says at a glance how full the pool is and where the blocks live.
"use strict";

export const NAMES = { ".": "free", c: "cached", u: "used", s: "shared", p: "pinned" };
const RANK = { ".": 0, c: 1, u: 2, s: 3, p: 4 };
const MAX_HEIGHT = 140;
const GAP = 1;

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

// Cells of `per` blocks each, drawn as the most notable state among their blocks.
function regroup(cells, per) {
  if (per === 1) return cells;
  let out = "";
  for (let i = 0; i < cells.length; i += per) {
    let best = ".";
    for (let j = i; j < Math.min(i + per, cells.length); j++) if (RANK[cells[j]] > RANK[best]) best = cells[j];
    out += best;
  }
  return out;
}

export class PoolView {
  constructor(title, cls = "") {
    this.title = el("h3", "", title);
    this.caption = el("p", "kv-caption");
    this.grid = el("div", "kv-grid " + cls);
    this.grid.setAttribute("role", "img");
    this.zoomed = false;
    this.zoom = el("button", "kv-zoom", "zoom");
    this.zoom.type = "button";
    this.zoom.title = "show every block at full size";
    this.zoom.addEventListener("click", () => {
      this.zoomed = !this.zoomed;
      this.zoom.textContent = this.zoomed ? "fit" : "zoom";
      this.layout = null;
      if (this.pool) this.draw(this.pool, this.what); // now: an idle server sends no new snapshot
    });
    this.title.append(" ", this.zoom);
    this.box = el("section", "kv-pool");
    this.box.append(this.title, this.caption, this.grid);
    this.marks = new Map(); // block -> css class (cow, hit), until the next draw clears it
    this.mine = new Set();
  }

  // Cell size and blocks per cell for `n` server cells in the strip's width.
  fit(n) {
    const width = Math.max(200, this.grid.clientWidth || 480);
    if (this.zoomed) return { size: 10, per: 1 };
    for (let size = 10; size >= 3; size--) {
      const cols = Math.floor(width / (size + GAP));
      if (Math.ceil(n / cols) * (size + GAP) <= MAX_HEIGHT) return { size, per: 1 };
    }
    const cols = Math.floor(width / (3 + GAP));
    const rows = Math.floor(MAX_HEIGHT / (3 + GAP));
    return { size: 3, per: Math.ceil(n / (cols * rows)) };
  }

  draw(pool, what) {
    this.pool = pool;
    this.what = what;
    const layout = this.layout && this.layout.n === pool.cells.length ? this.layout : { n: pool.cells.length, ...this.fit(pool.cells.length) };
    this.layout = layout;
    const cells = (this.cells = regroup(pool.cells, layout.per));
    this.per = pool.blocks_per_cell * layout.per;
    this.grid.style.setProperty("--cell", layout.size + "px");
    this.grid.dataset.perCell = String(this.per);
    this.grid.dataset.blocks = String(pool.num_blocks);
    const perText = this.per === 1 ? "one cell per block" : `one cell per ${this.per} blocks (the busiest state shown)`;
    this.caption.textContent = `${pool.num_blocks.toLocaleString("en")} blocks of ${what} · ${perText}`;
    if (this.grid.childElementCount !== cells.length) {
      const frag = document.createDocumentFragment();
      for (let i = 0; i < cells.length; i++) frag.appendChild(el("i"));
      this.grid.replaceChildren(frag);
    }
    const kids = this.grid.children;
    for (let i = 0; i < cells.length; i++) {
      let cls = "cell st-" + (NAMES[cells[i]] || "other");
      if (this.per === 1) {
        if (this.marks.has(i)) cls += " " + this.marks.get(i);
        if (this.mine.has(i)) cls += " mine";
      }
      if (kids[i].className !== cls) kids[i].className = cls;
    }
  }

  // The tooltip of a cell: its block(s), state, and for a shared block its ref count.
  describe(cell, refCounts, owners) {
    const i = Array.prototype.indexOf.call(this.grid.children, cell);
    if (i < 0 || !this.pool) return;
    const state = NAMES[this.cells[i]] || "?";
    if (this.per !== 1) {
      cell.title = `blocks ${i * this.per}–${i * this.per + this.per - 1}: at least one ${state}`;
      return;
    }
    const rc = refCounts[String(i)];
    const who = owners.get(i);
    cell.title = `block ${i}: ${state}` + (rc ? `, ref count ${rc} (shared)` : "") + (who ? ` · in ${who.join(", ")}` : "");
  }
}
