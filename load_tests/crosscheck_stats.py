"""The GuideLLM cross-check's figures (guidellm_crosscheck.py runs it): what each client's
run yields, under its own definitions and under one shared definition, and the comparison:
per run, and pooled over every request of each client's runs with how sure the ratio is.

A run's median moves with which point of the step cycle its requests land on and with the
shared machine's drift (docs/paper.md: +-15% between runs of one client), so one pair of
runs cannot settle a 10% question. Pooling the requests of several runs per client, run in
alternating order (ABBA: drift that is linear in time cancels), and resampling them gives
the ratio with an interval, and each client's run-to-run spread says how much of the
difference the box itself makes.
"""

from __future__ import annotations

import statistics

import numpy as np

METRICS = ("ttft_ms", "itl_ms", "ttft_sent_ms", "ttft_sched_ms", "itl_per_request_ms")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def guidellm_figures(report: dict) -> dict:
    """One GuideLLM JSON report (``--output kind=json``): its own medians, and its
    per-request timings under both clients' TTFT definitions."""
    bench = report["benchmarks"][0]
    metrics, done = bench["metrics"], bench["requests"]["successful"]
    timings = [r["info"]["timings"] for r in done]
    return {
        "completed": len(done),
        "errors": len(bench["requests"]["errored"]),
        "ttft_ms": metrics["time_to_first_token_ms"]["successful"]["median"],
        "itl_ms": metrics["inter_token_latency_ms"]["successful"]["median"],
        "ttft_sent_ms": _median(
            [1e3 * (t["first_token_iteration"] - t["request_start"]) for t in timings]
        ),
        "ttft_sched_ms": _median(
            [1e3 * (t["first_token_iteration"] - t["targeted_start"]) for t in timings]
        ),
        "itl_per_request_ms": _median(
            itl := [
                r["inter_token_latency_ms"] for r in done if r["inter_token_latency_ms"] is not None
            ]
        ),
        "ttft_sent_values": [
            1e3 * (t["first_token_iteration"] - t["request_start"]) for t in timings
        ],
        "itl_per_request_values": itl,
        "prompt_tokens": statistics.fmean(r["prompt_tokens"] for r in done)
        if done
        else float("nan"),
        "output_tokens": statistics.fmean(r["output_tokens"] for r in done)
        if done
        else float("nan"),
        "duration_s": bench["duration"],
    }


def harness_figures(records: list, duration: float) -> dict:
    """Our harness's records: its own summary (load_tests/metrics.py), and the same raw
    timings under GuideLLM's definitions."""
    from load_tests.metrics import summarize

    s = summarize(records, duration)
    done = [r for r in records if r.ok and r.chunk_times]
    per_request = [
        1e3 * (r.chunk_times[-1] - r.chunk_times[0]) / (r.output_tokens - 1)
        for r in done
        if r.output_tokens > 1
    ]
    return {
        "completed": s["completed"],
        "errors": s["errors"],
        "ttft_ms": s["ttft_ms"]["p50"],
        "itl_ms": s["itl_ms"]["p50"],
        "tpot_ms": s["tpot_ms"]["p50"],
        "ttft_sent_ms": _median(sent := [1e3 * (r.chunk_times[0] - r.sent) for r in done]),
        "ttft_sched_ms": _median([1e3 * (r.chunk_times[0] - r.scheduled) for r in done]),
        "itl_per_request_ms": _median(per_request),
        "ttft_sent_values": sent,
        "itl_per_request_values": per_request,
        "prompt_tokens": statistics.fmean(r.prompt_len for r in done) if done else float("nan"),
        "output_tokens": statistics.fmean(r.output_tokens for r in done) if done else float("nan"),
        "duration_s": duration,
    }


def compare(runs: list[dict]) -> dict:
    """Per metric: each client's median over its runs, ours ÷ GuideLLM, and the ratio of
    each adjacent pair (run i of GuideLLM with run i of ours) with their median: two runs side
    by side see about the same machine, so on a drifting box the median pair ratio is the
    robust reading (one pair that straddles a change of load cannot move it)."""
    out = {}
    for m in METRICS:
        g = [r[m] for r in runs if r["client"] == "guidellm"]
        h = [r[m] for r in runs if r["client"] == "harness"]
        pairs = [b / a for a, b in zip(g, h) if a]
        out[m] = {
            "guidellm": _median(g),
            "harness": _median(h),
            "ratio": _median(h) / _median(g) if g and h and _median(g) else float("nan"),
            "pair_ratios": pairs,
            "pair_ratio_median": _median(pairs),
        }
    return out


def format_table(runs: list[dict], summary: dict) -> str:
    head = (
        "| run | client | done | TTFT p50 (own) | ITL "
        "p50 (own) | TTFT from send | TTFT from schedule "
        "| ITL per request | client CPU s | server CPU s |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in runs:
        lines.append(
            f"| {r['pair']} | {r['client']} | {r['completed']} "
            f"| {r['ttft_ms']:.0f} | {r['itl_ms']:.0f} "
            f"| {r['ttft_sent_ms']:.0f} | {r['ttft_sched_ms']:.0f} | {r['itl_per_request_ms']:.0f} "
            f"| {r['client_cpu_s']:.1f} | {r['server_cpu_s']:.1f} |"
        )
    lines += [
        "",
        "| metric (ms, median of runs) | GuideLLM | ours "
        "| ours ÷ GuideLLM | per pair | median pair |",
        "|---|---|---|---|---|---|",
    ]
    for m, v in summary.items():
        lines.append(
            f"| {m} | {v['guidellm']:.0f} | {v['harness']:.0f} | {v['ratio']:.3f} "
            f"| {', '.join(f'{x:.2f}' for x in v['pair_ratios'])} | {v['pair_ratio_median']:.3f} |"
        )
    return "\n".join(lines)


# Per-request values each run keeps (same definition for both clients).
POOLED = ("ttft_sent_values", "itl_per_request_values")


def bootstrap_ratio(
    ours: list[float], theirs: list[float], resamples: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """median(ours) / median(theirs) and its 95% percentile-bootstrap interval (requests
    resampled within each client)."""
    a, b = np.asarray(ours, float), np.asarray(theirs, float)
    if not len(a) or not len(b):
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    ra = np.median(rng.choice(a, (resamples, len(a))), axis=1)
    rb = np.median(rng.choice(b, (resamples, len(b))), axis=1)
    lo, hi = np.percentile(ra / rb, [2.5, 97.5])
    return float(np.median(a) / np.median(b)), float(lo), float(hi)


def pooled(runs: list[dict]) -> dict:
    """Per pooled metric: each client's pooled median and run-median range, ours ÷ GuideLLM
    with its interval, and each client's run-to-run spread (largest ÷ smallest run median)."""
    out = {}
    for key in POOLED:
        by = {
            c: [r for r in runs if r["client"] == c and r.get(key)] for c in ("guidellm", "harness")
        }
        if not all(by.values()):
            continue
        values = {c: [v for r in rs for v in r[key]] for c, rs in by.items()}
        medians = {c: [float(np.median(r[key])) for r in rs] for c, rs in by.items()}
        ratio, lo, hi = bootstrap_ratio(values["harness"], values["guidellm"])
        out[key.removesuffix("_values")] = {
            "guidellm": float(np.median(values["guidellm"])),
            "harness": float(np.median(values["harness"])),
            "ratio": ratio,
            "ci95": [lo, hi],
            "requests": {c: len(v) for c, v in values.items()},
            "run_medians": medians,
            "run_spread": {c: max(m) / min(m) for c, m in medians.items()},
        }
    return out


def format_pooled(summary: dict) -> str:
    lines = [
        "| metric (ms, pooled requests) | GuideLLM | ours | ours ÷ GuideLLM | 95% interval "
        "| run spread GuideLLM / ours |",
        "|---|---|---|---|---|---|",
    ]
    for m, v in summary.items():
        lines.append(
            f"| {m} | {v['guidellm']:.0f} | {v['harness']:.0f} | {v['ratio']:.3f} "
            f"| {v['ci95'][0]:.3f}-{v['ci95'][1]:.3f} "
            f"| {v['run_spread']['guidellm']:.2f} / {v['run_spread']['harness']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Re-read saved cross-check JSON files (``guidellm_crosscheck --json-out``): each file's
    median pair ratio and pooled ratio, and all their pairs together."""
    import argparse
    import json

    p = argparse.ArgumentParser(
        prog="python -m load_tests.crosscheck_stats", description=main.__doc__
    )
    p.add_argument("files", nargs="+")
    args = p.parse_args(argv)
    all_pairs: dict[str, list[float]] = {m: [] for m in METRICS}
    print("| file | load avg | metric | median pair ratio | pair ratios | pooled ratio (95%) |")
    print("|---|---|---|---|---|---|")
    for path in args.files:
        with open(path) as f:
            data = json.load(f)
        summary, pool = compare(data["runs"]), pooled(data["runs"])
        load = data.get("load_average", [float("nan")])[0]
        for m, key in (("ttft_ms", "ttft_sent"), ("itl_ms", "itl_per_request")):
            v = summary[m]
            all_pairs[m] += v["pair_ratios"]
            pr = pool.get(key)
            pooled_text = (
                f"{pr['ratio']:.3f} ({pr['ci95'][0]:.2f}-{pr['ci95'][1]:.2f})" if pr else "-"
            )
            print(
                f"| {path} | {load:.1f} | {m} | {v['pair_ratio_median']:.3f} "
                f"| {', '.join(f'{x:.2f}' for x in v['pair_ratios'])} | {pooled_text} |"
            )
    for m in ("ttft_ms", "itl_ms"):
        pairs = all_pairs[m]
        within = sum(0.9 <= x <= 1.1 for x in pairs)
        print(
            f"all {len(pairs)} pairs, {m}: median {_median(pairs):.3f}, "
            f"range {min(pairs):.2f}-{max(pairs):.2f}, "
            f"{within} within 10%"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
