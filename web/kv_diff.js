// What happened between two KV snapshots, told with the blocks it touched: the counters
// say how many copies, hits or preemptions; the block tables of both snapshots say which
// blocks. Snapshots come every ~250 ms, several engine steps apart, so a block that was
// copied and freed in between can no longer be named (the event then says so).
"use strict";

const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;

function seqMap(snap) {
  const out = new Map(); // seq_id -> {req, seq}
  for (const req of snap.requests) for (const seq of req.seqs) out.set(seq.seq_id, { req, seq });
  return out;
}

// Copy-on-write: a table entry that moved off a block that was shared, or, for a request
// whose sequences were just forked (n samples, beams), the first logical block where the
// siblings' tables part: each of them got its own copy of a shared block there.
function copies(prev, cur) {
  const before = seqMap(prev), found = [];
  for (const req of cur.requests) {
    for (const seq of req.seqs) {
      const old = before.get(seq.seq_id);
      if (!old || seq.status === "swapped" || old.seq.status === "swapped") continue;
      const n = Math.min(old.seq.table.length, seq.table.length);
      for (let i = 0; i < n; i++) {
        const from = old.seq.table[i], to = seq.table[i];
        if (from !== to && prev.ref_counts[String(from)]) found.push({ seq: seq.seq_id, logical: i, from, to });
      }
    }
    const fresh = req.seqs.some((s) => !before.has(s.seq_id));
    const running = req.seqs.filter((s) => s.status !== "swapped");
    if (!fresh || running.length < 2) continue;
    const first = running[0].table;
    let i = 0;
    while (i < first.length && running.every((s) => s.table[i] === first[i])) i++;
    for (const s of running) {
      if (i < s.table.length && !found.some((f) => f.to === s.table[i])) found.push({ seq: s.seq_id, logical: i, from: null, to: s.table[i] });
    }
  }
  return found;
}

// Prefix-cache hits: blocks in a new request's table that were already computed in the
// previous snapshot (cached free, or in another request's table).
function reused(prev, cur) {
  const known = new Set(), hits = [];
  const per = prev.device.blocks_per_cell;
  for (const req of prev.requests) for (const s of req.seqs) if (s.status !== "swapped") s.table.forEach((b) => known.add(b));
  const ids = new Set(prev.requests.map((r) => r.request_id));
  for (const req of cur.requests) {
    if (ids.has(req.request_id)) continue;
    const blocks = new Set();
    for (const s of req.seqs) {
      for (const b of s.table) {
        if (s.status === "swapped") break;
        if (known.has(b) || (per === 1 && prev.device.cells[b] === "c")) blocks.add(b);
        else break; // a prefix hit is a run of leading blocks
      }
    }
    if (blocks.size) hits.push({ request: req.request_id, blocks: [...blocks] });
  }
  return hits;
}

export function diffSnapshots(prev, cur) {
  const d = (key) => (cur.counters[key] || 0) - (prev.counters[key] || 0);
  const events = [], marks = [];
  const cow = d("cow_copies");
  if (cow > 0) {
    const found = copies(prev, cur).slice(0, Math.max(cow, 8));
    const told = found.slice(0, 4).map((f) => `seq ${f.seq} logical ${f.logical}: ${f.from === null ? "" : `shared ${f.from} → `}copy ${f.to}`);
    const text = `copy-on-write: ${plural(cow, "block")} copied before a write` +
      (told.length ? ` (${told.join("; ")}${found.length > 4 ? "; …" : ""})` : " (already gone from the tables)");
    events.push({ key: "cow_copies", text, blocks: found.map((f) => f.to) });
    for (const f of found) marks.push({ block: f.to, cls: "cow" });
  }
  const hit = d("prefix_cache_hits");
  const found = hit > 0 ? reused(prev, cur) : [];
  if (hit > 0) {
    const told = found.slice(0, 2).map((h) => `${h.request.slice(0, 18)} maps ${h.blocks.length > 6 ? `${h.blocks.slice(0, 6).join(", ")}, …` : h.blocks.join(", ")}`);
    events.push({ key: "prefix_cache_hits", blocks: found.flatMap((h) => h.blocks),
                  text: `prefix cache: ${plural(hit, "prompt token")} reused, not recomputed` + (told.length ? ` (${told.join("; ")})` : "") });
    for (const h of found) for (const b of h.blocks) marks.push({ block: b, cls: "hit" });
  }
  // Sharing starts once a prefix is computed: a request whose prompt starts with a prefix
  // that another one is computing right now waits for it (the scheduler's SHARE_LATER),
  // then maps those blocks instead of computing its own copy.
  const waiting = cur.headline.waiting, free = cur.headline.free_blocks + cur.headline.cached_blocks;
  if (waiting > (prev.headline.waiting || 0) && free > cur.device.num_blocks / 10 && d("preemptions") <= 0) {
    events.push({ key: "late_sharing", text: `${plural(waiting, "request")} waiting with ${free.toLocaleString("en")} blocks free: ` +
      "either the batch is full (--max-num-seqs), or they begin with a prompt prefix that a running request is still " +
      "computing. A block can be shared only once its K/V are computed, so they wait for it and then reuse its blocks " +
      "(a prefix-cache hit) instead of computing copies." });
  }
  const pre = d("preemptions");
  if (pre > 0) {
    const before = seqMap(prev);
    const swapped = cur.requests.filter((r) => r.seqs.some((s) => s.status === "swapped" && before.get(s.seq_id)?.seq.status !== "swapped"));
    events.push({ key: "preemptions", text: `preempted ${plural(pre, "request")}: the pool ran out of free blocks, so the newest request ` +
      "gave all its blocks back (swapped to CPU, or dropped and recomputed later)" +
      (swapped.length ? ` — ${swapped.map((r) => r.request_id.slice(0, 18)).join(", ")} now in CPU blocks` : "") });
  }
  const out = d("swapped_out_blocks"), back = d("swapped_in_blocks"), ev = d("evictions");
  if (out > 0) events.push({ key: "swapped_out_blocks", text: `swapped ${plural(out, "block")} out to CPU RAM` });
  if (back > 0) events.push({ key: "swapped_in_blocks", text: `swapped ${plural(back, "block")} back in from CPU RAM` });
  if (ev > 0) events.push({ key: "evictions", text: `evicted ${plural(ev, "cached block")} (free blocks were needed; their prefix-cache entries are gone)` });
  return { events, marks };
}
