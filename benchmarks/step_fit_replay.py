"""How well the prefill cap's step-cost fit (core/step_budget.py) predicted a GPU run's steps,
with and without the decode rows' context terms: the run's step records
(bench_throughput.py --step-report, benchmarks/step_report.py's fields) replayed in order
through StepCostModel, each step observed one step late (as with async scheduling), seeded
with the run's own warm-up samples where the report has them.

    python benchmarks/step_fit_replay.py --records docs/gpu_runs/session7/lead/call1/throughput.json

For each fit it prints the one-step-ahead misses, log(measured / predicted), of steps with
decodes and prompt tokens (what the cap's margin has to cover) and of decode-only steps, and
how the fit's decode-only estimate beside each prompt step compares with step_report.py's
decode-only fit of the run at the step's rows and contexts (the fitted measure's
denominator: where the cap's estimate runs high, it lets too many prompt tokens in), by band
of decode batch. Then the same models fitted in-sample over the whole run (least squares),
which says what the terms can explain at best. The records keep the prompt tokens the run's
cap chose: this measures predictions, not a different cap's choices (sim_prefill_cap.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SEED_CONTEXT = 256  # engine/step_warmup.py's DECODE_CONTEXT when the records were taken
BANDS = ((1, 64), (64, 128), (128, 192), (192, 257))


def _stats(xs: list[float]) -> str:
    if not xs:
        return "-"
    xs = sorted(xs)
    mean = sum(xs) / len(xs)
    sd = (sum((x - mean) ** 2 for x in xs) / len(xs)) ** 0.5
    return f"mean {mean:+.4f} sd {sd:.4f} p99 {xs[min(len(xs) - 1, int(0.99 * len(xs)))]:+.4f} (n {len(xs)})"


def replay(records: list[dict], seed: list, context_term: bool, token_sizes: list[int], peer) -> dict:
    from streamkv.core.step_budget import StepCostModel

    model = StepCostModel(2.0, context_term=context_term)
    # reports before the context term list no context: the plan's then
    model.seed([(s[0], s[1], 1e-3 * s[2], s[3] if len(s) > 3 else SEED_CONTEXT * s[0]) for s in seed], token_sizes)
    mixed, pure, high = [], [], {band: [] for band in BANDS}
    pending = None
    for r in records:
        d, p, k, ms = r["decodes"], r["prompt_tokens"], r["context_tokens"], r["ms"]
        if d:
            predicted = model.predict(d, p, k)
            if predicted:
                (mixed if p else pure).append(math.log(1e-3 * ms / predicted))
            decode_only = model.predict(d, 0, k)
            if p and decode_only and peer is not None:
                band = next(b for b in BANDS if b[0] <= d < b[1])
                high[band].append(math.log(1e3 * decode_only / peer(d, k, r.get("max_context", 0))))
        if pending is not None:
            model.observe(*pending)
        pending = (d, p, 1e-3 * ms, k)
    return {"mixed": mixed, "pure": pure, "decode_estimate_vs_run_fit": high, "padded": model.padded,
            "coefficients": model.coefficients()}


def in_sample(records: list[dict], token_sizes: list[int]) -> None:
    import numpy as np

    from streamkv.core.step_budget import StepCostModel

    sized = StepCostModel(2.0, token_sizes=tuple(token_sizes))
    steps = [r for r in records if r["decodes"]]
    t = np.array([r["ms"] for r in steps])
    mixed = np.array([bool(r["prompt_tokens"]) for r in steps])
    for padded in (False, True):
        base = [[1.0, r["decodes"], sized._rows(r["decodes"], r["prompt_tokens"]) if padded else r["prompt_tokens"],
                 m := float(bool(r["prompt_tokens"])), r["decodes"] * m] for r in steps]
        ctx = np.array([r["context_tokens"] for r in steps], float)
        for name, extra in (("none", []), ("g*context", [ctx]), ("g*context + h*[prompt]*context", [ctx, ctx * mixed])):
            x = np.column_stack([np.array(base)] + extra)
            coef, *_ = np.linalg.lstsq(x, t, rcond=None)
            miss = np.log(t / (x @ coef))
            terms = ", ".join(f"{c * 1e3:.2e} us" for c in coef[5:]) or "-"
            print(f"  {'padded' if padded else 'plain':>6} {name:<31} log miss sd: prompt steps "
                  f"{miss[mixed].std():.4f}, decode-only {miss[~mixed].std():.4f}; context per token {terms}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", required=True, help="a bench_throughput.py --step-report JSON with records")
    ap.add_argument("--seed-records", default=None,
                    help="take the warm-up samples from this report instead (for reports without them)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=8192)
    args = ap.parse_args()

    from benchmarks.step_report import decode_only_fit
    from streamkv.worker.cuda_graphs import capture_sizes, context_buckets
    from streamkv.worker.piecewise_graphs import token_buckets

    with open(args.records) as f:
        report = json.load(f)["step_report"]
    records = [dict(zip(report["record_fields"], r)) for r in report["records"]]
    seed_report = report
    if args.seed_records:
        with open(args.seed_records) as f:
            seed_report = json.load(f)["step_report"]
    seed = seed_report["prefill_cap"].get("warmup_samples") or []
    if not seed:
        print("no warm-up samples: pass --seed-records", file=sys.stderr)
        return 2
    sizes = token_buckets(args.max_num_batched_tokens)
    pure = [r for r in records if r["decodes"] and not r["prompt_tokens"]]
    if "max_context" not in report["record_fields"]:  # older records: the context bucket unknown
        for r in records:
            r["max_context"] = 0
    fit = decode_only_fit(pure, capture_sizes(args.max_num_seqs), context_buckets(args.max_model_len))
    peer = fit[0] if fit else None
    print(f"{args.records}: {len(records)} steps, seeded with {len(seed)} warm-up samples")
    for context_term in (False, True):
        r = replay(records, seed, context_term, sizes, peer)
        print(f"context term {'on' if context_term else 'off'} (fit at the end: "
              f"{'padded' if r['padded'] else 'plain'}, coefficients in s "
              f"{', '.join(f'{c:.3g}' for c in r['coefficients'] or ())})")
        print(f"  one step ahead, log(measured / predicted): prompt steps {_stats(r['mixed'])}")
        print(f"                                             decode-only  {_stats(r['pure'])}")
        for band, xs in r["decode_estimate_vs_run_fit"].items():
            print(f"  decodes {band[0]:>3}-{band[1] - 1:<3}: log(fit's decode-only / run's decode-only fit) {_stats(xs)}")
    print("in-sample least squares over the whole run:")
    in_sample(records, sizes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
