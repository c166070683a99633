"""Every engine step of a run timed (bench_throughput.py --step-report): prompt-bearing against
decode-only steps, the prefill cap's figure (issue 18: every step with prompt tokens <= 2x
the time of a decode-only step of the same decode batch), and time to first token with every
request arriving at once.

"The same decode batch" is the same rows at the same contexts. A run seldom has a
decode-only step of exactly that batch: while a burst ramps up every step carries prompt
tokens, and the next decode-only steps of about that size come at the run's tail, hundreds
of steps later, with contexts several times longer (at 256 rows a decode-only step took
7.3 ms at p50 and 12.3 at p99 over session 6's run: the context, not the batch). So the
ratio's denominator is the decode-only step time at the prompt step's own decode rows and
context tokens, from a least-squares fit of the run's decode-only steps,
``t = alpha + beta*batch + gamma*context_tokens + delta_k*[context bucket k]`` over the decode
graphs' shapes (worker/cuda_graphs.py: the batch padded to a captured size, the longest
context's bucket sizing the attention grid), which read the weights once and each row's K/V
once; its misses are reported. Session 6's figure, the median of decode-only steps within
+-16 decodes anywhere in the run, is kept beside it as ``run_wide``.
"""

from __future__ import annotations

import statistics
import time
from bisect import bisect_left

# One record per step, in this order (the JSON's "records"): decode rows, prompt tokens, prompt
# spans, context tokens behind the decode rows and the longest of them, device ms, wall ms since
# the step before, and the cap's fit's prediction in ms for the step and for a decode-only step
# of its decode rows (None while the fit is not usable).
RECORD_FIELDS = ("decodes", "prompt_tokens", "spans", "context_tokens", "max_context", "ms", "wall_ms", "fit_ms",
                 "fit_decode_ms")


def run_streamkv_steps(llm, requests) -> tuple[float, dict]:
    """Every request arriving at once, each engine step timed: its time on the device (CUDA
    events around the step's work, which start when the step before it is done; on a CPU the
    step's wall time) with what it carried, and each request's time to first token. With
    async scheduling a step's host work overlaps the step before it, so the device time is
    the step's own cost."""
    from streamkv import SamplingParams

    engine = llm.engine
    cost = engine.scheduler.step_cost
    steps: list[dict] = []
    complete = engine._complete
    last = [time.perf_counter()]

    def timed_complete(step, finished_only):
        out = step.sched
        rows = [s for s in out.scheduled if s.num_new_tokens == 1]
        lengths = [len(s.seq) for s in rows]  # before this step's token is appended
        decode = out.num_decodes  # a prompt's one-token last chunk is a prompt token
        prompt = out.num_batched_tokens - decode
        fit = cost.predict(decode, prompt) if decode else None  # the fit as the cap last saw it
        fit_decode = cost.predict(decode, 0) if decode else None
        outputs = complete(step, finished_only)
        now = time.perf_counter()
        wall, last[0] = now - last[0], now
        if step.handle is not None and step.error is None and out.scheduled:
            timed = getattr(step.handle, "device_seconds", None)
            ms = 1e3 * (timed() if timed is not None else time.perf_counter() - step.submitted)
            # wall: since the step before was completed (one step's share of the run's time)
            steps.append({"step": len(steps), "prompt_tokens": prompt, "decodes": decode, "ms": ms,
                          "wall_ms": 1e3 * wall, "spans": len(out.scheduled) - len(rows),
                          "context_tokens": sum(lengths), "max_context": max(lengths, default=0),
                          "fit_ms": None if fit is None else 1e3 * fit,
                          "fit_decode_ms": None if fit_decode is None else 1e3 * fit_decode})
        return outputs

    engine._complete = timed_complete
    done = {}
    try:
        start = time.perf_counter()
        for i, r in enumerate(requests):
            engine.add_request(f"s{i}", None, SamplingParams(temperature=0, ignore_eos=True, max_tokens=r.output_len),
                               list(r.prompt_ids))
        while engine.has_unfinished_requests():
            for out in engine.step(finished_only=True):
                done[out.request_id] = out
        elapsed = time.perf_counter() - start
    finally:
        engine._complete = complete
    ttft = sorted(o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in done.values())
    return elapsed, summarize(steps, ttft, engine, elapsed)


def _graph_shape(engine):
    """The decode graphs' batch sizes and context buckets on this engine (worker/cuda_graphs.py)."""
    from streamkv.worker.cuda_graphs import capture_sizes, context_buckets

    return capture_sizes(engine.config.scheduler.max_num_seqs), context_buckets(engine.model_info.max_model_len)


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def decode_only_fit(pure: list[dict], sizes: list[int], buckets: list[int]):
    """A function (decodes, context tokens, longest context) -> ms of a decode-only step,
    fitted on the run's decode-only steps over the graphs' shapes (see the module docstring),
    its coefficients and the spread of its misses; None with too few steps to fit."""
    import numpy as np

    if len(pure) < 8:
        return None

    def features(decodes: int, context: int, longest: int) -> list[float]:
        batch = sizes[min(bisect_left(sizes, decodes), len(sizes) - 1)]
        bucket = min(bisect_left(buckets, longest), len(buckets) - 1)
        return [1.0, float(batch), float(context)] + [float(bucket == k) for k in range(1, len(buckets))]

    x = np.array([features(s["decodes"], s["context_tokens"], s["max_context"]) for s in pure])
    t = np.array([s["ms"] for s in pure])
    coef, *_ = np.linalg.lstsq(x, t, rcond=None)  # a bucket no step reached gets 0 (least norm)
    miss = sorted((t / (x @ coef)).tolist())

    def predict(decodes: int, context: int, longest: int) -> float:
        return float(np.dot(coef, features(decodes, context, longest)))

    named = {"alpha": coef[0], "beta_per_batch_row": coef[1], "gamma_per_context_token": coef[2],
             **{f"delta_bucket_{b}": coef[2 + k] for k, b in enumerate(buckets[1:], start=1)}}
    return predict, {k: float(v) for k, v in named.items()}, {
        "p1": _pct(miss, 0.01), "p50": _pct(miss, 0.5), "p99": _pct(miss, 0.99)}


def _ratio_summary(compared: list[dict]) -> dict:
    ratios = sorted(c["ratio"] for c in compared)
    return {"p50": _pct(ratios, 0.5), "p90": _pct(ratios, 0.9), "p99": _pct(ratios, 0.99),
            "max": ratios[-1] if ratios else None, "compared": len(ratios),
            "over_2x": sum(1 for r in ratios if r > 2.0),
            "worst": sorted(compared, key=lambda c: -c["ratio"])[:8]}


def summarize(steps: list[dict], ttft: list[float], engine, elapsed: float) -> dict:
    mixed = [s for s in steps if s["prompt_tokens"]]
    pure = [s for s in steps if not s["prompt_tokens"] and s["decodes"]]
    # A step without decodes has no decode-only step of its batch, and no request waits on it
    # for a token (the cap leaves it the whole budget): it is reported apart.
    beside = [s for s in mixed if s["decodes"]]
    fit = decode_only_fit(pure, *_graph_shape(engine))
    same_batch = None
    if fit is not None:
        predict, coefficients, misses = fit
        rows = []
        for s in beside:
            peer = predict(s["decodes"], s["context_tokens"], s["max_context"])
            rows.append({**s, "decode_step_ms": peer, "ratio": s["ms"] / peer})
        same_batch = {**_ratio_summary(rows), "fit_ms": coefficients, "fit_misses": misses}
    # Session 6's: the median decode-only step within +-16 decodes, anywhere in the run.
    run_wide, prefill_only = [], []
    for s in mixed:
        peers = [p["ms"] for p in pure if abs(p["decodes"] - s["decodes"]) <= 16]
        if peers:
            peer = statistics.median(peers)
            (run_wide if s["decodes"] else prefill_only).append({**s, "decode_step_ms": peer, "ratio": s["ms"] / peer})
    run_wide_summary = {**_ratio_summary(run_wide), "no_peer": len(beside) - len(run_wide),
                        "max_with_prefill_only": max((c["ratio"] for c in run_wide + prefill_only), default=None)}
    warmup = engine.step_warmup
    cost = engine.scheduler.step_cost
    return {
        "steps": len(steps), "prompt_steps": len(mixed), "decode_steps": len(pure),
        "prefill_only_steps": len(mixed) - len(beside),
        "wall_ms_per_step": 1e3 * elapsed / max(len(steps), 1),
        "prompt_step_ms": {q: _pct(sorted(s["ms"] for s in mixed), q) for q in (0.5, 0.9, 0.99)},
        "decode_step_ms": {q: _pct(sorted(s["ms"] for s in pure), q) for q in (0.5, 0.9, 0.99)},
        "decode_step_wall_ms": {q: _pct(sorted(s["wall_ms"] for s in pure), q) for q in (0.5, 0.9, 0.99)},
        # Issue 18's target: every prompt-bearing step <= 2x a decode-only step of its batch.
        "prompt_vs_decode_step": same_batch,
        "prompt_vs_decode_step_run_wide": run_wide_summary,
        "prefill_cap": {"ratio": engine.config.scheduler.max_prefill_step_ratio,
                        "seeded": bool(warmup and warmup.usable),
                        "warmup_ms": 1e3 * warmup.seconds if warmup else 0.0,
                        "warmup_steps": len(warmup.samples) if warmup else 0,
                        # how far below the ratio the cap aimed at the end, per decode band
                        "margins": cost.margins(), "coefficients": cost.coefficients(),
                        "padded_fit": cost.padded,
                        # (decodes, prompt tokens, ms, the decode rows' context tokens) each
                        "warmup_samples": [[d, p, 1e3 * t, k] for d, p, t, k in warmup.samples] if warmup else []},
        "prompt_step_share_of_time": sum(s["ms"] for s in mixed) / max(sum(s["ms"] for s in steps), 1e-9),
        "ttft_s": {"p50": _pct(ttft, 0.5), "p99": _pct(ttft, 0.99)},
        "max_prompt_tokens_per_step": max((s["prompt_tokens"] for s in steps), default=0),
        "record_fields": RECORD_FIELDS,
        "records": [[round(v, 3) if isinstance(v, float) else v for v in (s[k] for k in RECORD_FIELDS)]
                    for s in steps],
    }


def _print_ratios(name: str, r: dict, extra: str) -> None:
    top = f"{r['max']:.2f}x" if r["max"] is not None else "-"
    print(f"  prompt step / {name}: p50 {r['p50']:.2f}x, p90 {r['p90']:.2f}x, p99 {r['p99']:.2f}x, "
          f"max {top}; {r['over_2x']} of {r['compared']} over 2x{extra}")


def print_step_report(rep: dict) -> None:
    print(f"steps {rep['steps']}: {rep['prompt_steps']} with prompt tokens "
          f"({100 * rep['prompt_step_share_of_time']:.0f}% of step time; {rep['prefill_only_steps']} without "
          f"decodes, not compared: nobody waits on them), {rep['decode_steps']} decode-only")
    print(f"  (ms: a step's time on the device; wall: since the step before it completed; "
          f"{rep['wall_ms_per_step']:.2f} ms per step over the run)")
    for name in ("prompt_step_ms", "decode_step_ms", "decode_step_wall_ms"):
        q = rep[name]
        print(f"  {name:<19} p50 {q[0.5]:8.2f}  p90 {q[0.9]:8.2f}  p99 {q[0.99]:8.2f}")
    same, wide, cap = rep["prompt_vs_decode_step"], rep["prompt_vs_decode_step_run_wide"], rep["prefill_cap"]
    if same is not None:
        f, m = same["fit_ms"], same["fit_misses"]
        buckets = ", ".join(f"+{v:.2f} at {k[13:]}" for k, v in f.items() if k.startswith("delta_bucket_"))
        _print_ratios("decode-only step of the same rows and contexts", same,
                      f"\n    (decode-only ms = {f['alpha']:.3f} + {f['beta_per_batch_row']:.5f} * graph batch + "
                      f"{f['gamma_per_context_token']:.3e} * context tokens, by the longest context's bucket: "
                      f"{buckets}; measured / fitted p1 {m['p1']:.3f}, p50 {m['p50']:.3f}, p99 {m['p99']:.3f})")
        for w in same["worst"][:5]:
            print(f"    step {w['step']:>5}: {w['decodes']:>3} decodes ({w['context_tokens']:>6} context) + "
                  f"{w['prompt_tokens']:>4} prompt tokens in {w['spans']:>2} spans {w['ms']:7.2f} ms vs "
                  f"{w['decode_step_ms']:6.2f} ms = {w['ratio']:.2f}x (fit said "
                  + (f"{w['fit_ms']:.2f} ms)" if w["fit_ms"] is not None else "-)"))
    _print_ratios("median decode-only step within +-16 decodes, run-wide (session 6's)", wide,
                  f" ({wide['no_peer']} had none)")
    margins = ", ".join(f"{k} {v:.3f}" for k, v in cap["margins"].items() if v is not None) or "none yet"
    print(f"  prefill cap {cap['ratio']}: fit seeded at start: {'yes' if cap['seeded'] else 'no'} "
          f"({cap['warmup_steps']} timed warm-up steps, {cap['warmup_ms']:.0f} ms in all); "
          f"aimed at ratio / margin at the end, by decode band: {margins}; mixed steps fitted by "
          f"{'their graph size' if cap['padded_fit'] else 'their tokens'}")
    print(f"  time to first token (all arrive at once): p50 {rep['ttft_s']['p50']:.2f} s, "
          f"p99 {rep['ttft_s']['p99']:.2f} s")
