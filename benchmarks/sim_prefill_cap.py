"""The prefill cap (core/step_budget.py) offline, on a device modelled from a GPU run's step
report: the requests all arriving at once through the real Scheduler and the real
StepCostModel, seeded by the warm-up's plan (engine/step_warmup.py) timed on the model, every
step's time from the model with log-normal noise, observed one step late (as with async
scheduling). Prints the prompt-step ratio against the modelled decode-only step of the same
rows and contexts (the model's own, so the issue's definition exactly), the ratio measured
with the noise, output tok/s and time to first token, and the GPU step report's two figures
over the noisy steps (its fit of the run's decode-only steps, and the median decode-only step
within +-16 decodes). No GPU: a candidate cap is checked before a device call, and a run's
records can be replayed against another cap (--context-term: the fit's context term).

    python benchmarks/sim_prefill_cap.py --records docs/gpu_runs/session7/hp/t1000_b.json \\
        --workload-file bench_inputs/sharegpt_1000.json --seeds 0,1,2

The model, fitted from the records (benchmarks/step_report.py's fields): a decode-only step
costs ``alpha + beta*graph batch + gamma*context tokens`` (steps whose rows hold under 700
context tokens each: the decode graphs' first context bucket); a step with prompt tokens
costs ``max(floor, alpha' + beta'*graph size + gamma'*context tokens + delta'*decodes)``, the
graph size being the piecewise graphs' token count that holds it and the floor the fastest
such step of at most 128 tokens (eager attention in every layer). Both context costs are
fitted from the records; only the warm-up's share of them is assumed (--seed-context-cost: its
rows share their context's blocks). ``--device binned`` adds to each decode-only step the
records' median excess over that line at its graph batch (session 7's H200: -0.2 ms at 1 row,
+2.6 at 3-4 rows, +0.8 at 9-16, then within +-0.5: what a line in the batch misses);
``--seed-from`` seeds the cap with a run's own warm-up samples, timed on its GPU (session 7's
32-row decode-only step took 6.5 ms where the run's steps say ~5.1).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
from bisect import bisect_left
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ceil(sizes: list[int], n: int) -> int:
    return sizes[min(bisect_left(sizes, n), len(sizes) - 1)]


@dataclass(slots=True)
class Device:
    decode: list[float]  # alpha, beta, gamma
    mixed: list[float]  # alpha', beta', gamma', delta'
    floor: float
    batch_sizes: list[int]
    token_sizes: list[int]
    # Per decode graph batch: the run's decode-only steps' median miss of the linear model, ms
    # (--device binned; empty: the linear model alone).
    batch_excess: dict[int, float]

    def ms(self, decodes: int, prompt: int, context: int) -> float:
        if not prompt:
            a, b, g = self.decode
            batch = _ceil(self.batch_sizes, decodes)
            return a + b * batch + g * context + self.batch_excess.get(batch, 0.0)
        a, b, g, d = self.mixed
        return max(self.floor, a + b * _ceil(self.token_sizes, decodes + prompt) + g * context + d * decodes)


def fit_device(records: list[dict], max_num_seqs: int, token_budget: int, binned: bool = False) -> Device:
    import numpy as np

    from streamkv.worker.cuda_graphs import capture_sizes
    from streamkv.worker.piecewise_graphs import token_buckets

    batch, tokens = capture_sizes(max_num_seqs), token_buckets(token_budget)
    pure = [r for r in records if r["decodes"] >= 5 and not r["prompt_tokens"]
            and r["context_tokens"] < 700 * r["decodes"]]
    mixed = [r for r in records if r["decodes"] and r["prompt_tokens"]]
    x = np.array([[1.0, _ceil(batch, r["decodes"]), r["context_tokens"]] for r in pure])
    decode, *_ = np.linalg.lstsq(x, np.array([r["ms"] for r in pure]), rcond=None)
    big = [r for r in mixed if _ceil(tokens, r["decodes"] + r["prompt_tokens"]) >= 256]
    x = np.array([[1.0, _ceil(tokens, r["decodes"] + r["prompt_tokens"]), r["context_tokens"], r["decodes"]]
                  for r in big])
    mix, *_ = np.linalg.lstsq(x, np.array([r["ms"] for r in big]), rcond=None)
    small = [r["ms"] for r in mixed if _ceil(tokens, r["decodes"] + r["prompt_tokens"]) <= 128]
    floor = min(small) if small else mix[0] + mix[1] * 128
    excess: dict[int, list[float]] = {}
    for r in records if binned else ():
        if r["decodes"] and not r["prompt_tokens"]:
            size = _ceil(batch, r["decodes"])
            linear = decode[0] + decode[1] * size + decode[2] * r["context_tokens"]
            excess.setdefault(size, []).append(r["ms"] - linear)
    median = {int(size): float(sorted(xs)[len(xs) // 2]) for size, xs in excess.items() if len(xs) >= 5}
    return Device(decode.tolist(), mix.tolist(), floor, batch, tokens, median)


def simulate(device: Device, workload: list, args, seed: int) -> dict:
    from streamkv.config import SchedulerConfig
    from streamkv.core.block_manager import BlockManager
    from streamkv.core.scheduler import Scheduler
    from streamkv.core.step_budget import StepCostModel
    from streamkv.engine.step_warmup import DECODE_CONTEXT, WarmupShape, plan, row_context
    from streamkv.sampling_params import SamplingParams
    from streamkv.sequence import Sequence, SequenceGroup, SequenceStatus

    rng = random.Random(seed)
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                             max_model_len=args.max_model_len)
    config.verify()
    bm = BlockManager(16, args.num_kv_blocks, 0, enable_prefix_caching=False, watermark=0.0)
    sched = Scheduler(config, bm)
    cost = sched.step_cost = StepCostModel(args.ratio, context_term=args.context_term == "on")
    noisy = lambda ms: ms * math.exp(rng.gauss(0.0, args.noise))  # noqa: E731
    shape = WarmupShape(config.token_budget, args.max_num_seqs, 16, args.num_kv_blocks, args.max_model_len, 32000)
    context, points = plan(shape, cost.context_term)
    # The engine passes the rows' nominal context; the device charges its share (shared blocks).
    samples = [(p.decodes, p.prompt_tokens, 1e-3 * noisy(device.ms(p.decodes, p.prompt_tokens, int(
        args.seed_context_cost * row_context(shape, p, context) * p.decodes))),
        row_context(shape, p, context) * p.decodes) for p in points]
    if args.seed_samples:  # a real run's warm-up, timed on its GPU
        samples = [(s[0], s[1], 1e-3 * s[2], s[3] if len(s) > 3 else DECODE_CONTEXT * s[0])
                   for s in args.seed_samples]
    cost.seed(samples, device.token_sizes)
    ids = iter(range(10**9))
    clock, pending, steps, first = 0.0, None, [], {}

    def add(name: str, prompt: list[int], out_len: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        seq_id = next(ids)
        sched.add(SequenceGroup(name, [Sequence(seq_id, list(prompt))], params, arrival_time=float(seq_id)))

    def run() -> None:
        nonlocal clock, pending
        while sched.has_unfinished():
            out = sched.schedule()
            if pending is not None:  # the step before is observed after this one is planned
                cost.observe(*pending)
                pending = None
            if not out.scheduled:
                continue
            rows = [s for s in out.scheduled if s.num_new_tokens == 1]
            decodes, kv = out.num_decodes, sum(len(s.seq) for s in rows)
            prompt = out.num_batched_tokens - decodes
            true = device.ms(decodes, prompt, kv)
            ms = noisy(true)
            clock += ms / 1e3
            pending = (decodes, prompt, ms / 1e3, kv)
            steps.append((decodes, prompt, kv, ms, max((len(s.seq) for s in rows), default=0)))
            for s in out.scheduled:
                sample = s.do_sample  # before the computed count moves
                s.seq.num_computed_tokens += s.num_new_tokens
                bm.mark_computed(s.seq)
                if sample:
                    s.seq.append_token(7, 0.0, None)
                    if len(s.seq.output_token_ids) >= s.group.sampling_params.max_tokens:
                        s.seq.status = SequenceStatus.FINISHED_LENGTH
                    first.setdefault(s.group.request_id, clock)
            sched.free_finished_seqs()

    for i, (p, o) in enumerate(workload[: args.warmup_requests]):  # as the bench does before its run
        add(f"w{i}", p, o)
    run()
    steps.clear()
    first.clear()
    clock = 0.0
    for i, (p, o) in enumerate(workload):
        add(f"s{i}", p, min(o, args.max_output_len))
    run()
    gpu = gpu_measures(steps, args)
    beside = [(d, p, kv, ms) for d, p, kv, ms, _ in steps if d and p]
    true = sorted(device.ms(d, p, kv) / device.ms(d, 0, kv) for d, p, kv, _ in beside)
    measured = sorted(ms / device.ms(d, 0, kv) for d, p, kv, ms in beside)
    ttft = sorted(first.values())
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    out_tokens = sum(min(o, args.max_output_len) for _, o in workload)
    worst = sorted(beside, key=lambda r: -device.ms(r[0], r[1], r[2]) / device.ms(r[0], 0, r[2]))[:5]
    return {"seed": seed, "steps": len(steps), "prompt_steps": len(beside),
            "worst": [{"decodes": d, "prompt_tokens": p, "context_per_row": kv / d,
                       "ratio": device.ms(d, p, kv) / device.ms(d, 0, kv)} for d, p, kv, _ in worst],
            "p50": pct(true, 0.5), "p90": pct(true, 0.9), "p99": pct(true, 0.99), "max": true[-1],
            "over_2x": sum(r > args.ratio for r in true), "measured_max": measured[-1],
            "measured_over_2x": sum(r > args.ratio for r in measured),
            "output_tok_s": out_tokens / clock, "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99), **gpu}


def gpu_measures(steps: list[tuple], args) -> dict:
    """The GPU step report's two figures over the simulated steps' noisy times (step_report.py):
    against its fit of the run's decode-only steps ("fitted"), and against the median decode-only
    step within +-16 decodes anywhere in the run (session 6's, the issue's: "run_wide")."""
    import statistics

    from benchmarks.step_report import decode_only_fit
    from streamkv.worker.cuda_graphs import capture_sizes, context_buckets

    pure = [{"decodes": d, "context_tokens": kv, "max_context": mx, "ms": ms} for d, p, kv, ms, mx in steps if d and not p]
    beside = [(d, kv, ms, mx) for d, p, kv, ms, mx in steps if d and p]
    fit = decode_only_fit(pure, capture_sizes(args.max_num_seqs), context_buckets(args.max_model_len))
    fitted = sorted(ms / fit[0](d, kv, mx) for d, kv, ms, mx in beside) if fit else [float("nan")]
    wide = []
    for d, _, ms, _ in beside:
        peers = [r["ms"] for r in pure if abs(r["decodes"] - d) <= 16]
        if peers:
            wide.append(ms / statistics.median(peers))
    wide.sort()
    return {"fitted_over_2x": sum(r > args.ratio for r in fitted), "fitted_max": fitted[-1],
            "fitted_p99": fitted[min(len(fitted) - 1, int(0.99 * len(fitted)))],
            "run_wide_over_2x": sum(r > args.ratio for r in wide), "run_wide_max": wide[-1] if wide else float("nan")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", required=True, help="a bench_throughput.py --step-report JSON with records")
    ap.add_argument("--workload-file", required=True, help="JSON of [[prompt ids], output len] pairs")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--num-kv-blocks", type=int, default=20000)
    ap.add_argument("--ratio", type=float, default=2.0, help="max_prefill_step_ratio")
    ap.add_argument("--noise", type=float, default=0.04, help="log-normal spread of a step's time")
    ap.add_argument("--seed-context-cost", type=float, default=1.0,
                    help="share of the warm-up decode rows' context the model charges (their rows share "
                         "its blocks: 0 if those reads all hit the L2 cache)")
    ap.add_argument("--context-term", choices=("on", "off"), default="off",
                    help="the cap's fit with the decode rows' context terms (StepCostModel.context_term)")
    ap.add_argument("--device", choices=("linear", "binned"), default="linear",
                    help="binned: decode-only steps also pay the records' median excess over the linear "
                         "model at each decode graph batch (what the GPU ran that the model misses)")
    ap.add_argument("--seed-from", default=None,
                    help="seed the cap with the warm-up samples of this step report (prefill_cap.warmup_samples: "
                         "timed on the GPU) instead of the plan timed on the model")
    ap.add_argument("--warmup-requests", type=int, default=4, help="requests run before, as bench_throughput does")
    ap.add_argument("--seeds", default="0", help="comma list of noise seeds")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    with open(args.records) as f:
        report = json.load(f)["step_report"]
    records = [dict(zip(report["record_fields"], r)) for r in report["records"]]
    with open(args.workload_file) as f:
        workload = json.load(f)[: args.num_requests]
    args.seed_samples = None
    if args.seed_from:
        with open(args.seed_from) as f:
            args.seed_samples = json.load(f)["step_report"]["prefill_cap"]["warmup_samples"]
    device = fit_device(records, args.max_num_seqs, args.max_num_batched_tokens, args.device == "binned")
    print(f"device model from {args.records}: decode-only {device.decode}, mixed {device.mixed}, "
          f"floor {device.floor:.2f} ms; decode graph batches' excess (ms): "
          + (", ".join(f"{b}: {x:+.2f}" for b, x in sorted(device.batch_excess.items())) or "none"))
    rows = [simulate(device, workload, args, int(s)) for s in args.seeds.split(",")]
    print(f"{'seed':>4} {'prompt steps':>12} {'p50':>6} {'p90':>6} {'p99':>6} {'max':>6} {'over 2x':>8} "
          f"{'measured max':>13} {'over':>5} {'tok/s':>8} {'TTFT p50':>9} {'p99':>6} | GPU report's: "
          f"{'fitted over':>11} {'p99':>5} {'max':>5} {'+-16 over':>9} {'max':>5}")
    for r in rows:
        print(f"{r['seed']:>4} {r['prompt_steps']:>12} {r['p50']:>6.2f} {r['p90']:>6.2f} {r['p99']:>6.2f} "
              f"{r['max']:>6.2f} {r['over_2x']:>8} {r['measured_max']:>13.2f} {r['measured_over_2x']:>5} "
              f"{r['output_tok_s']:>8.0f} {r['ttft_p50_s']:>9.2f} {r['ttft_p99_s']:>6.2f} | {'':>14}"
              f"{r['fitted_over_2x']:>11} {r['fitted_p99']:>5.2f} {r['fitted_max']:>5.2f} "
              f"{r['run_wide_over_2x']:>9} {r['run_wide_max']:>5.2f}")
        for w in r["worst"][:3] if r["over_2x"] else ():
            print(f"       {w['decodes']:>3} decodes (context {w['context_per_row']:.0f} a row) + "
                  f"{w['prompt_tokens']:>4} prompt tokens: {w['ratio']:.2f}x")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "device": asdict(device), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
