"""Swap vs recompute (the paper's Fig 19a): the time to swap a request's KV blocks out to CPU
memory and back in, against the time to recompute them (one prefill of that context), over
block sizes and context lengths. Prints a table, writes JSON, fits the cost model that
``preemption_mode=auto`` uses (streamkv/core/preemption.py) and, with --write-costs, stores
it as a profile of streamkv/core/preemption_costs.json (and makes it the default).

    # the CPU (embedded model):
    python benchmarks/bench_swap_recompute.py --device cpu --context-lens 64,128,256,512
    # one H200, OPT-13B's shape with dummy weights (docs/paper.md, Fig 19):
    python benchmarks/bench_swap_recompute.py --model opt-13b --load-format dummy --dtype float16 \\
        --device cuda --recompute-block-sizes 16 --write-costs cuda

Swap: the worker's own pools and transfer (worker/cache_engine.py, one gather/scatter kernel
and one transfer per run of consecutive CPU ids, all layers at once) for ceil(context /
block size) blocks; block ids are drawn at random from pools twice that size (a pool after
churn: few runs), or consecutive with --layout contiguous. Recompute: the engine itself
(`LLM.generate`, prefix cache off, the whole context in one step, one token sampled), so it
counts what a re-prefill costs the engine, scheduling included. Median of --repeats runs
after a warm-up.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BLOCK_SIZES = "1,2,4,8,16,32,64,128,256"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _timed(fn, sync, repeats: int, clock=time.perf_counter) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        sync()
        times.append(clock() - start)
    return statistics.median(times) * 1e3


def measure_swap(args, info, device, dtype, sync) -> list[dict]:
    import torch

    from streamkv.worker.cache_engine import CacheEngine

    head_dim = (
        info.hf_config.get("head_dim") or info.hf_config["hidden_size"] // info.num_attention_heads
    )
    gen = torch.Generator().manual_seed(0)
    rows = []
    for bs in args.block_sizes:
        most = -(-max(args.context_lens) // bs)
        cache = CacheEngine(
            info.num_layers, info.num_kv_heads, head_dim, bs, 2 * most, 2 * most, dtype, device
        )
        for ctx in args.context_lens:
            n = -(-ctx // bs)
            dev = torch.randperm(2 * most, generator=gen)[:n].tolist()
            cpu = (
                list(range(n))
                if args.layout == "contiguous"
                else torch.randperm(2 * most, generator=gen)[:n].tolist()
            )
            out, back = list(zip(dev, cpu)), list(zip(cpu, dev))
            ms = _timed(
                lambda c=cache, o=out, b=back: (c.swap_out(o), c.swap_in(b)),
                sync,
                args.repeats,
                args.timer,
            )
            rows.append({"block_size": bs, "context_len": ctx, "num_blocks": n, "swap_ms": ms})
            print(
                f"swap       block {bs:>3}  context {ctx:>5}  blocks {n:>5}  out+in {ms:9.3f} ms",
                flush=True,
            )
        cache = None  # noqa: F841 - the pools go before the next size's are made
        gc.collect()
    return rows


def measure_recompute(args, sync) -> list[dict]:
    import random

    from streamkv import SamplingParams
    from streamkv.entrypoints.llm import LLM

    rows = []
    longest = max(args.context_lens)
    for bs in args.recompute_block_sizes:
        llm = LLM(
            args.model,
            device=args.device,
            dtype=args.dtype,
            load_format=args.load_format,
            block_size=bs,
            num_kv_blocks=-(-(longest + 1) // bs) + 4,
            num_swap_blocks=0,
            enable_prefix_caching=False,
            max_model_len=longest + 1,
            max_num_batched_tokens=max(longest, 256),
            enforce_eager=True,
        )
        vocab = llm.engine.model_info.vocab_size
        rng = random.Random(bs)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        for ctx in args.context_lens:
            prompt = [rng.randrange(4, vocab) for _ in range(ctx)]
            ms = _timed(
                lambda e=llm, p=prompt, sp=params: e.generate(
                    prompt_token_ids=[p], sampling_params=sp
                ),
                sync,
                args.repeats,
                args.timer,
            )
            rows.append({"block_size": bs, "context_len": ctx, "recompute_ms": ms})
            print(f"recompute  block {bs:>3}  context {ctx:>5}  prefill {ms:9.3f} ms", flush=True)
        llm.shutdown()
        llm = None  # noqa: F841 - the engine and its pools go before the next one is built
        gc.collect()
    return rows


def fit(swaps: list[dict], recomputes: list[dict]) -> dict:
    """Least squares of core/preemption.py's two formulas (negative terms clamped to 0)."""
    import numpy as np

    a = np.array([[1.0, r["num_blocks"], r["num_blocks"] * r["block_size"]] for r in swaps])
    y = np.array([r["swap_ms"] / 2 for r in swaps])  # one transfer
    call, per_block, per_token = np.clip(np.linalg.lstsq(a, y, rcond=None)[0], 0, None)
    a = np.array([[1.0, r["context_len"], r["context_len"] ** 2] for r in recomputes])
    y = np.array([r["recompute_ms"] for r in recomputes])
    fixed, per_tok, quad = np.clip(np.linalg.lstsq(a, y, rcond=None)[0], 0, None)
    return {
        "call_ms": float(call),
        "block_us": float(per_block * 1e3),
        "token_us": float(per_token * 1e3),
        "fixed_ms": float(fixed),
        "token_ms": float(per_tok),
        "quad_ns": float(quad * 1e6),
    }


def write_costs(path: str, profile: str, costs: dict) -> None:
    data = {"default": profile, "profiles": {}}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data["profiles"][profile] = costs
    data["default"] = profile
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def plot(path: str, swaps: list[dict], recomputes: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    for ctx in sorted({r["context_len"] for r in swaps}):
        pts = [(r["block_size"], r["swap_ms"]) for r in swaps if r["context_len"] == ctx]
        ax.plot(*zip(*pts), "o-", label=f"swap out+in, {ctx} tok")
        rec = [r["recompute_ms"] for r in recomputes if r["context_len"] == ctx]
        if rec:
            ax.axhline(
                statistics.median(rec),
                ls="--",
                lw=1,
                color=ax.lines[-1].get_color(),
                label=f"recompute, {ctx} tok",
            )
    ax.set_xscale("log", base=2)
    sizes = sorted({r["block_size"] for r in swaps})
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_yscale("log")
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("ms")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    from streamkv.core.preemption import COSTS_FILE, PreemptionCosts, choose

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default=None,
        help="default: the embedded SmolLM2; opt-13b: its shape (dummy weights)",
    )
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--block-sizes", type=_ints, default=_ints(BLOCK_SIZES))
    ap.add_argument(
        "--recompute-block-sizes",
        type=_ints,
        default=None,
        help="block sizes of the recompute runs (an engine each; default: --block-sizes)",
    )
    ap.add_argument("--context-lens", type=_ints, default=_ints("256,512,1024,2000"))
    ap.add_argument("--layout", choices=["scattered", "contiguous"], default="scattered")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--clock",
        choices=["auto", "wall", "cpu"],
        default="auto",
        help="wall time, or this process's CPU time with "
        "torch on one thread (auto: cpu on the CPU, "
        "where other jobs' load inflates wall time but not CPU time)",
    )
    ap.add_argument("--json-out", default="bench_results/swap_recompute.json")
    ap.add_argument("--plot", default=None, help="write the Fig 19a PNG here")
    ap.add_argument(
        "--write-costs",
        metavar="PROFILE",
        default=None,
        help=f"store the fitted constants as PROFILE in {COSTS_FILE.name} and make it the default",
    )
    ap.add_argument("--costs-file", default=str(COSTS_FILE))
    ap.add_argument(
        "--replot",
        metavar="JSON",
        default=None,
        help=(
            "only draw --plot from a --json-out file (e.g. "
            "one written on a GPU box without matplotlib)"
        ),
    )
    args = ap.parse_args()
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        plot(
            args.plot,
            saved["swap"],
            saved["recompute"],
            f"swap vs recompute: {saved['source'].split(', ', 1)[1]}",
        )
        return 0
    args.recompute_block_sizes = args.recompute_block_sizes or args.block_sizes

    import torch

    from streamkv.config import ModelConfig
    from streamkv.models.loader import resolve_model_info
    from streamkv.worker.worker import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.clock == "auto":
        args.clock = "cpu" if device.type == "cpu" else "wall"
    args.timer = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.clock == "cpu":
        torch.set_num_threads(1)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    info = resolve_model_info(
        ModelConfig(model=args.model, max_model_len=max(args.context_lens) + 1)
    )
    start = time.perf_counter()
    swaps = measure_swap(args, info, device, dtype, sync)
    recomputes = measure_recompute(args, sync)
    elapsed = time.perf_counter() - start
    where = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({os.cpu_count()} cores)"
    )
    source = (
        f"bench_swap_recompute.py, {info.model_dir.name} {dtype} on {where}, {args.layout} ids, "
        f"{args.clock} time"
    )
    costs = fit(swaps, recomputes)
    model = PreemptionCosts(**costs, source=source)

    rec = {}
    for r in recomputes:
        rec.setdefault(r["context_len"], []).append(r["recompute_ms"])
    print(
        f"\n{'block':>5}{'context':>8}{'blocks':>7}"
        f"{'swap ms':>10}{'recompute ms':>13}{'swap/rec':>9}"
        f"{'fit swap':>9}{'fit rec':>8}  auto"
    )
    for r in swaps:
        recompute = statistics.median(rec[r["context_len"]])
        r["recompute_ms"] = recompute
        r["auto"] = choose(
            model, r["num_blocks"], r["block_size"], r["context_len"], r["num_blocks"]
        )
        print(
            f"{r['block_size']:>5}{r['context_len']:>8}{r['num_blocks']:>7}{r['swap_ms']:>10.2f}{recompute:>13.2f}"
            f"{r['swap_ms'] / recompute:>9.2f}"
            f"{model.swap_ms(r['num_blocks'], r['block_size']):>9.2f}"
            f"{model.recompute_ms(r['context_len']):>8.2f}  {r['auto']}"
        )
    print(f"\nfitted ({source}): " + ", ".join(f"{k} {v:.4g}" for k, v in costs.items()))
    print(f"measured in {elapsed:.1f} s")
    os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump(
            {
                "args": {k: v for k, v in vars(args).items() if k != "timer"},
                "source": source,
                "seconds": elapsed,
                "swap": swaps,
                "recompute": recomputes,
                "fit": costs,
            },
            f,
            indent=1,
        )
    if args.plot:
        plot(args.plot, swaps, recomputes, f"swap vs recompute: {info.model_dir.name} on {where}")
    if args.write_costs:
        write_costs(args.costs_file, args.write_costs, {**costs, "source": source})
        print(f"wrote profile {args.write_costs!r} to {args.costs_file} (now the default)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
