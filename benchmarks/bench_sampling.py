"""Sampling throughput: the same requests decoded greedily and with each sampling mode, in
one run on one engine, as output tokens per second and as a ratio to greedy. Modes:

- greedy: temperature 0
- temp_top_p: temperature 0.8, top_p 0.95
- seeded_top_k: temperature 0.8, top_k 50, a seed per request
- penalties: temperature 0.8, presence 0.5, frequency 0.5, repetition 1.2

Prompts are random token ids (no tokenizer or data set needed); every request decodes
exactly --output-len tokens (EOS ignored). With --rounds > 1 the modes alternate round by
round and the median is kept, so drift in the machine's speed hits every mode alike. Prints
a table and writes JSON. With the in-process executor it also reports the time spent in the
sampler per step (the worker's Sampler.__call__). On a GPU that includes waiting for the
step's forward pass, since the sampler's first host sync waits for it: compare the modes'
figures with each other, or use --sampler-only for the sampler alone.

    python benchmarks/bench_sampling.py --device cpu --num-requests 64 --output-len 32
    python benchmarks/bench_sampling.py --sampler-only --device cuda --vocab-size 128256

With --sampler-only it times the Sampler alone instead, on random logits of --max-num-seqs
rows (each penalised row with a 110-token prompt and 128 outputs counted): ms per call (the
tokens read back), and on CUDA the GPU time per call (torch.profiler) for the kernel path
(kernels_cu/sampling.cu) and the torch reference path.
    python benchmarks/bench_sampling.py --model llama3-8b --load-format dummy --dtype bfloat16 \
        --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = {
    "greedy": {"temperature": 0.0},
    "temp_top_p": {"temperature": 0.8, "top_p": 0.95},
    "seeded_top_k": {"temperature": 0.8, "top_k": 50, "seed": 0},
    "penalties": {
        "temperature": 0.8,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.2,
    },
}


def mode_params(mode: str, num: int, output_len: int) -> list:
    from streamkv import SamplingParams

    base = {**MODES[mode], "max_tokens": output_len, "ignore_eos": True}
    if "seed" in base:
        return [SamplingParams(**{**base, "seed": i}) for i in range(num)]
    return [SamplingParams(**base) for _ in range(num)]


class SamplerClock:
    """Stands in for the in-process worker's sampler and times its calls (each ends in a
    host sync, so wall time is the sampler's whole cost). ``path``: "auto" calls the Sampler
    (its own dispatch: the kernel on CUDA), "torch" its torch reference path."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler
        self.path = "auto"
        self.seconds, self.calls = 0.0, 0

    def __call__(self, logits, reqs):
        start = time.perf_counter()
        try:
            return (self.sampler._in_torch if self.path == "torch" else self.sampler)(logits, reqs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1

    def reset(self) -> tuple[float, int]:
        out = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return out


def _gpu_ms(fn, calls: int) -> tuple[float, float]:
    """GPU time per call of ``fn`` from torch.profiler: every kernel and copy, and the
    sampling kernel (kernels_cu/sampling.cu) alone."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = ours = 0.0
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        us = getattr(e, "self_cuda_time_total", 0.0) if us is None else us
        total += us
        ours += us if "sample_kernel" in e.key else 0.0
    return total / 1e3 / calls, ours / 1e3 / calls


def sampler_only(args, modes: list[str]) -> list[dict]:
    """ms per Sampler call on random logits, each mode over the same rows; on CUDA for the
    kernel path and the torch reference path (``Sampler._in_torch``), with GPU time per call."""
    import torch

    from streamkv.layers.penalties import TokenCounts
    from streamkv.layers.sample_request import SampleRequest
    from streamkv.layers.sampler import Sampler
    from streamkv.models.loader import load_config, resolve_model_dir

    dev = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else "cpu"
        if args.device == "auto"
        else args.device
    )
    vocab = args.vocab_size or load_config(resolve_model_dir(args.model))["vocab_size"]
    rows = args.max_num_seqs
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    logits = torch.randn(rows, vocab, generator=gen, device=dev).mul_(3).to(torch.bfloat16)
    counts = TokenCounts(vocab, dev, capacity=rows)
    rng = random.Random(args.seed)
    count_rows = [
        counts.allocate(
            [rng.randrange(vocab) for _ in range(110)], [rng.randrange(vocab) for _ in range(128)]
        )
        for _ in range(rows)
    ]
    sampler = Sampler(args.seed, dev)
    paths = (
        {"kernel": sampler, "torch": sampler._in_torch}
        if dev.type == "cuda"
        else {"torch": sampler}
    )
    out = []
    for path, call in paths.items():
        for mode in modes:
            p = dict(MODES[mode])
            seeded = p.pop("seed", None) is not None
            reqs = [
                SampleRequest(
                    **p,
                    seed=i if seeded else None,
                    output_pos=128,
                    counts=counts,
                    counts_row=count_rows[i],
                )
                for i in range(rows)
            ]

            def step(call=call, reqs=reqs) -> None:
                call(logits, reqs).results()  # reads the tokens: every call ends in a sync

            for _ in range(3):
                step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.calls):
                step()
            row = {
                "mode": mode,
                "path": path,
                "params": MODES[mode],
                "ms_per_call": 1e3 * (time.perf_counter() - start) / args.calls,
            }
            if dev.type == "cuda":
                row["gpu_ms_per_call"], row["kernel_ms_per_call"] = _gpu_ms(step, args.calls)
            out.append(row)
    print(
        f"\nsampler alone on {dev}: {rows} rows x {vocab} "
        f"vocabulary (bf16 logits), mean of {args.calls} calls"
    )
    print(f"{'mode':<14}{'path':<8}{'ms/call':>10}{'GPU ms/call':>13}{'kernel ms':>11}")
    for r in out:
        gpu = f"{r['gpu_ms_per_call']:.3f}" if "gpu_ms_per_call" in r else "-"
        ker = f"{r['kernel_ms_per_call']:.3f}" if "kernel_ms_per_call" in r else "-"
        print(f"{r['mode']:<14}{r['path']:<8}{r['ms_per_call']:>10.3f}{gpu:>13}{ker:>11}")
    return out


def run_mode(llm, prompts: list[list[int]], params: list) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - start
    for p, o in zip(params, outs):
        assert len(o.outputs[0].token_ids) == p.max_tokens, "a request stopped early"
    return elapsed


def _profile_gpu_ms(
    llm, prompts: list[list[int]], cases: list[tuple], clock, args
) -> dict[tuple, float]:
    """GPU ms per step for each case, every kernel and copy (torch.profiler), over a run of
    --profile-steps output tokens at the full batch."""
    gpu_ms: dict[tuple, float] = {}
    batch = min(args.num_requests, args.max_num_seqs)
    for case in cases:
        clock.reset()
        clock.path = case[1]
        params = mode_params(case[0], batch, args.profile_steps)
        total, _ = _gpu_ms(lambda params=params: run_mode(llm, prompts[:batch], params), 1)
        gpu_ms[case] = total / max(clock.reset()[1], 1)
    return gpu_ms


def _rows(
    cases: list[tuple],
    times: dict,
    sampler_ms: dict,
    step_ms: dict,
    overlap: dict,
    steps: dict,
    gpu_ms: dict,
    args,
) -> list[dict]:
    """One row per (mode, path) case: medians over the rounds, and the speed against greedy."""
    out_tokens = args.num_requests * args.output_len
    rows = []
    for case in cases:
        t = statistics.median(times[case])
        row = {
            "mode": case[0],
            "path": case[1],
            "params": MODES[case[0]],
            "seconds": t,
            "output_tok_s": out_tokens / t,
        }
        if sampler_ms[case]:
            row["sampler_ms_per_step"] = statistics.median(sampler_ms[case])
            row["wall_ms_per_step"] = statistics.median(step_ms[case])
            row["overlapped_fraction"] = statistics.median(overlap[case])
            row["steps"] = statistics.median(steps[case])
        if case in gpu_ms:
            row["gpu_ms_per_step"] = gpu_ms[case]
        rows.append(row)
    for r in rows:
        greedy = next(
            (g["output_tok_s"] for g in rows if g["mode"] == "greedy" and g["path"] == r["path"]),
            None,
        )
        r["vs_greedy"] = r["output_tok_s"] / greedy if greedy else None
    return rows


def _print_table(rows: list[dict], name: dict, llm, args) -> None:
    ex = llm.engine.executor
    print(
        f"\nmodel {args.model or 'embedded'} ({args.load_format}, {ex.dtype}, {ex.device}), "
        f"{llm.engine.config.model.executor_backend} executor; {args.num_requests} requests x "
        f"{args.output_len} tokens, prompts {args.prompt_len} "
        f"tokens, max_num_seqs {args.max_num_seqs}, "
        f"median of {args.rounds}"
    )
    print(
        f"{'mode':<20}{'seconds':>9}{'out tok/s':>11}"
        f"{'vs greedy':>10}{'sampler ms':>11}{'ms/step':>9}"
        f"{'steps':>7}{'overlap':>8}{'GPU ms/step':>12}"
    )
    for r in rows:
        ratio = f"{r['vs_greedy']:.3f}" if r["vs_greedy"] is not None else "-"

        def f(key: str, fmt: str = ".2f", r=r) -> str:
            return format(r[key], fmt) if key in r else "-"

        print(
            f"{name[(r['mode'], r['path'])]:<20}{r['seconds']:>9.2f}"
            f"{r['output_tok_s']:>11.1f}{ratio:>10}"
            f"{f('sampler_ms_per_step'):>11}{f('wall_ms_per_step'):>9}"
            f"{f('steps', '.0f'):>7}{f('overlapped_fraction'):>8}"
            f"{f('gpu_ms_per_step'):>12}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default=None, help="HF dir, .gguf or preset (default: the embedded model)"
    )
    ap.add_argument(
        "--load-format", default="auto", help="'dummy' for random weights of a real shape"
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=400)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=110, help="random token ids per prompt")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="default: enough for every request on CPU, sized from memory on GPU",
    )
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--rounds", type=int, default=1, help="timed runs per mode (median kept)")
    ap.add_argument("--distributed-executor-backend", default=None, choices=["inprocess", "mp"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument(
        "--sampler-only", action="store_true", help="time the Sampler alone on random logits"
    )
    ap.add_argument(
        "--vocab-size", type=int, default=None, help="--sampler-only: default the model's"
    )
    ap.add_argument("--calls", type=int, default=20, help="--sampler-only: timed calls per mode")
    ap.add_argument(
        "--sampler-paths",
        default="auto",
        help="comma list: auto (the Sampler's dispatch: the "
        "kernel on CUDA), torch (its torch reference path); in-process executor only",
    )
    ap.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="then per case, GPU ms per step over a run of "
        "this many output tokens (torch.profiler)",
    )
    ap.add_argument("--json-out", default="bench_results/sampling.json")
    args = ap.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    if args.sampler_only:
        rows = sampler_only(args, modes)
        os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "sampler_only": rows}, f, indent=2)
        return 0

    import torch

    from streamkv.entrypoints.llm import LLM
    from streamkv.models.loader import load_config, resolve_model_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    per_seq = -(-(args.prompt_len + args.output_len) // 16) + 1
    blocks = args.num_kv_blocks or (
        min(args.num_requests, args.max_num_seqs) * per_seq + 16 if on_cpu else None
    )
    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        max_num_seqs=args.max_num_seqs,
        num_kv_blocks=blocks,
        num_swap_blocks=0,
        distributed_executor_backend=args.distributed_executor_backend,
    )
    vocab = load_config(resolve_model_dir(args.model))["vocab_size"]
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
        for _ in range(args.num_requests)
    ]
    worker = getattr(llm.engine.executor, "worker", None)
    clock = SamplerClock(worker.runner.sampler) if worker is not None else None
    if clock is not None:
        worker.runner.sampler = clock

    paths = args.sampler_paths.split(",") if clock is not None else ["auto"]
    cases = [(m, p) for p in paths for m in modes]
    name = {c: c[0] if len(paths) == 1 else f"{c[0]}/{c[1]}" for c in cases}
    for mode in modes:  # warm-up: kernels, graphs, allocator
        warm = min(8, len(prompts))
        run_mode(llm, prompts[:warm], mode_params(mode, warm, min(args.output_len, 8)))
    # And once at the full batch: on the H200 the first run at that size was ~15% slower per
    # step, and only the first mode timed paid it.
    run_mode(llm, prompts, mode_params(modes[0], len(prompts), min(args.output_len, 32)))
    times: dict[tuple, list[float]] = {c: [] for c in cases}
    sampler_ms: dict[tuple, list[float]] = {c: [] for c in cases}
    step_ms: dict[tuple, list[float]] = {c: [] for c in cases}
    overlap: dict[tuple, list[float]] = {c: [] for c in cases}
    steps: dict[tuple, list[int]] = {c: [] for c in cases}
    for _ in range(args.rounds):
        for case in cases:
            mode, path = case
            overlapped = llm.engine.overlapped_steps
            if clock is not None:
                clock.reset()
                clock.path = path
            times[case].append(
                run_mode(llm, prompts, mode_params(mode, args.num_requests, args.output_len))
            )
            if clock is not None:
                seconds, calls = clock.reset()
                sampler_ms[case].append(1e3 * seconds / max(calls, 1))
                step_ms[case].append(1e3 * times[case][-1] / max(calls, 1))
                overlap[case].append((llm.engine.overlapped_steps - overlapped) / max(calls, 1))
                steps[case].append(calls)
            print(f"{name[case]}: {times[case][-1]:.2f}s", flush=True)
    gpu_ms: dict[tuple, float] = {}
    if args.profile_steps and clock is not None and not on_cpu:
        gpu_ms = _profile_gpu_ms(llm, prompts, cases, clock, args)

    rows = _rows(cases, times, sampler_ms, step_ms, overlap, steps, gpu_ms, args)
    ex = llm.engine.executor
    _print_table(rows, name, llm, args)
    os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump(
            {
                "args": vars(args),
                "device": str(ex.device),
                "dtype": str(ex.dtype),
                "times": {name[c]: t for c, t in times.items()},
                "rows": rows,
            },
            f,
            indent=2,
        )
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
