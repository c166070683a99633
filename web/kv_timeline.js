// The last minute of the KV cache on a time axis: device pool usage and CPU swap usage as
// lines, and a tick for every preemption, swap, copy-on-write and prefix-cache hit, so a
// learner sees the pool fill, the scheduler preempt, and the swapped blocks come back.
// Snapshots only arrive when something changed, so the axis is wall-clock time.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const WINDOW_MS = 60_000;
const W = 300, H = 60;
export const MARKS = {
  preemptions: ["preempt", "preemption"],
  swapped_out_blocks: ["swap-out", "swap out"],
  swapped_in_blocks: ["swap-in", "swap in"],
  cow_copies: ["cow", "copy-on-write"],
  prefix_cache_hits: ["hit", "prefix hit"],
};

function svg(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  return e;
}

export class Timeline {
  constructor() {
    this.samples = []; // {t, usage, swap}
    this.marks = []; // {t, kind, count}
    this.svg = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", class: "kv-timeline", role: "img" });
    this.svg.setAttribute("aria-label", "KV usage over the last minute");
    this.legend = document.createElement("div");
    this.legend.className = "kv-tl-legend";
    const items = [["usage", "device pool used"], ["swap", "CPU swap used"],
      ...Object.values(MARKS).map(([cls, label]) => [cls, label])];
    for (const [cls, label] of items) {
      const s = document.createElement("span");
      s.className = "tl-key tl-" + cls;
      s.textContent = label;
      this.legend.appendChild(s);
    }
    this.box = document.createElement("section");
    this.box.className = "kv-timeline-box";
    const title = document.createElement("h3");
    title.textContent = "Last minute";
    this.box.append(title, this.svg, this.legend);
  }

  add(snap, prevCounters, now = Date.now()) {
    const h = snap.headline;
    this.samples.push({ t: now, usage: h.kv_usage, swap: snap.cpu.num_blocks ? h.cpu_used_blocks / snap.cpu.num_blocks : 0 });
    if (prevCounters) {
      for (const key of Object.keys(MARKS)) {
        const d = snap.counters[key] - prevCounters[key];
        if (d > 0) this.marks.push({ t: now, kind: key, count: d });
      }
    }
    this.draw(now);
  }

  draw(now = Date.now()) {
    const from = now - WINDOW_MS;
    // Keep one sample before the window so the line enters from the left edge.
    const firstIn = this.samples.findIndex((s) => s.t >= from);
    if (firstIn > 1) this.samples.splice(0, firstIn - 1);
    this.marks = this.marks.filter((m) => m.t >= from);
    const x = (t) => Math.max(0, ((t - from) / WINDOW_MS) * W).toFixed(1);
    const y = (v) => (H - 2 - v * (H - 4)).toFixed(1);
    const line = (key) => {
      const pts = [];
      this.samples.forEach((s, i) => {
        if (i > 0) pts.push(`${x(s.t)},${y(this.samples[i - 1][key])}`); // a step: values hold until the next snapshot
        pts.push(`${x(s.t)},${y(s[key])}`);
      });
      const last = this.samples[this.samples.length - 1];
      if (last) pts.push(`${W},${y(last[key])}`);
      return svg("polyline", { points: pts.join(" "), class: "tl-line tl-" + key, fill: "none" });
    };
    const kids = [svg("rect", { x: 0, y: 0, width: W, height: H, class: "tl-bg" })];
    for (const m of this.marks) {
      const [cls, label] = MARKS[m.kind];
      const tick = svg("line", { x1: x(m.t), x2: x(m.t), y1: 0, y2: H, class: "tl-mark tl-" + cls });
      tick.appendChild(svg("title", {})).textContent = `${label} (${m.count}) at ${new Date(m.t).toLocaleTimeString()}`;
      kids.push(tick);
    }
    kids.push(line("swap"), line("usage"));
    this.svg.replaceChildren(...kids);
    this.svg.dataset.samples = String(this.samples.length);
  }
}
