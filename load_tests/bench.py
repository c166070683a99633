"""Open-loop serving benchmark (like ``vllm bench serve``): requests arrive by a Poisson or
gamma process at a fixed rate or a sweep of rates, against the OpenAI API (HTTP+SSE), the
chat WebSocket, or the offline engine in this process; every run prints a summary block,
and the whole sweep goes to one JSON file (and a latency-vs-rate PNG with --plot).

    # a streamkv server on this machine (loopback only), a sweep of three rates:
    python -m load_tests.bench --backend openai --url http://127.0.0.1:8000 \\
        --workload sharegpt --num-requests 200 --request-rate 1,2,4 --label paged

    # the offline engine with a baseline allocator (benchmark-only flag):
    python -m load_tests.bench --backend offline --device cpu --num-kv-blocks 256 \\
        --no-enable-prefix-caching --kv-allocation orca-oracle --workload alpaca \\
        --num-requests 100 --request-rate 2,4,8

Plots of several systems' JSON files: ``python -m load_tests.plot --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
from dataclasses import asdict

from load_tests import capacity, kv
from load_tests.arrivals import arrival_times, parse_rates
from load_tests.metrics import parse_slo, summarize
from load_tests.report import format_summary, plot_latency
from load_tests.workloads import WORKLOADS, BenchRequest, build

MAX_REQUESTS, MAX_DURATION = 5000, 3600.0


def build_parser() -> argparse.ArgumentParser:
    from streamkv.config import KV_ALLOCATIONS
    from streamkv.entrypoints.args import add_engine_args

    p = argparse.ArgumentParser(
        prog="python -m load_tests.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--backend", choices=["openai", "websocket", "offline"], default="openai")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server URL (loopback only)")
    p.add_argument("--api-key", default=os.environ.get("STREAMKV_API_KEY"))
    p.add_argument(
        "--ws-per-socket",
        type=int,
        default=8,
        help="generations per WebSocket (the server's --ws-max-active)",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="sharegpt")
    w.add_argument(
        "--num-requests", type=int, default=200, help=f"per rate point (<= {MAX_REQUESTS})"
    )
    w.add_argument("--n", type=int, default=1, help="parallel samples per request")
    w.add_argument("--beam-width", type=int, default=0, help="beam search of this width (0: off)")
    w.add_argument(
        "--length-scale",
        type=float,
        default=1.0,
        help="shrink every prompt and output by this factor (a small-pool CPU run)",
    )
    w.add_argument(
        "--max-len",
        type=int,
        default=2048,
        help="ShareGPT: prompt + output at most (before scaling)",
    )
    w.add_argument("--prefix-len", type=int, default=341, help="shared-prefix: the prefix's tokens")
    # --tokenizer (the workload's tokenizer directory, default: the embedded model's) is the
    # engine flag of the same name, added with the engine flags below.
    w.add_argument(
        "--workload-seed", type=int, default=0, help="seeds the workload sample and the arrivals"
    )
    w.add_argument(
        "--save-workload",
        default=None,
        metavar="PATH",
        help="write the built requests (token ids, output lengths) to PATH and exit",
    )
    w.add_argument(
        "--workload-file",
        default=None,
        metavar="PATH",
        help="requests from a --save-workload file (no dataset or tokenizer needed)",
    )
    a = p.add_argument_group("arrivals and limits")
    a.add_argument(
        "--request-rate", default="1", help="req/s, or a comma-separated sweep; 'inf' = all at once"
    )
    a.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, < 1 burstier"
    )
    a.add_argument(
        "--max-duration",
        type=float,
        default=600.0,
        help=f"seconds per rate point (<= {MAX_DURATION:.0f})",
    )
    o = p.add_argument_group("output")
    o.add_argument(
        "--label",
        default=None,
        help="system name in reports and plots (default: the KV allocation)",
    )
    o.add_argument(
        "--goodput",
        nargs="*",
        metavar="KEY:MS",
        help="SLOs for goodput: ttft, tpot, e2e (ms), norm (ms/token)",
    )
    o.add_argument("--json-out", default="bench_results/bench.json")
    o.add_argument(
        "--append",
        action="store_true",
        help="add this sweep's points to --json-out's (same system and workload): extend a sweep",
    )
    o.add_argument("--plot", default=None, help="write a latency-vs-rate PNG here")
    o.add_argument("--disable-tqdm", action="store_true")
    o.add_argument(
        "--point-dir",
        default=None,
        metavar="DIR",
        help=(
            "also one JSON per rate point here, with its capacity figures (load_tests/capacity.py)"
        ),
    )
    o.add_argument(
        "--figure",
        default="",
        help="the paper's figure a --point-dir point is for (recorded in it)",
    )
    o.add_argument(
        "--record-steps",
        type=int,
        default=0,
        metavar="N",
        help="offline: keep a uniform sample of N steps' times and work per point, for "
        "load_tests/fit_steps.py (0: off)",
    )
    e = p.add_argument_group("offline engine (--backend offline)")
    e.add_argument("--model", default=None, help="model for the offline engine (default: embedded)")
    e.add_argument(
        "--simulate",
        action="store_true",
        help="no model: the real engine with a step-time "
        "model on a virtual clock (load_tests/sim.py); "
        "needs --num-kv-blocks",
    )
    e.add_argument("--sim-base-ms", type=float, default=20.0, help="simulated step: fixed ms")
    e.add_argument(
        "--sim-token-ms", type=float, default=0.08, help="simulated step: ms per computed token"
    )
    e.add_argument(
        "--sim-kv-us", type=float, default=0.55, help="simulated step: us per context token read"
    )
    e.add_argument(
        "--sim-swap-block-us",
        type=float,
        default=10.0,
        help="simulated swap: us per block moved (each way; one transfer per block)",
    )
    e.add_argument(
        "--sim-swap-token-us",
        type=float,
        default=32.8,
        help="simulated swap: us per token slot moved (each way; 800 KiB at ~25 GB/s)",
    )
    e.add_argument(
        "--sim-block-us",
        type=float,
        default=0.0,
        help="simulated step: us per KV block the contexts span (the kernel's per-block cost)",
    )
    e.add_argument(
        "--orca-allocator",
        choices=["first-fit", "buddy"],
        default="first-fit",
        help="where an orca-* baseline's runs go: the engine's first-fit slot space, or the buddy "
        "allocator the paper assumes for Orca (load_tests/buddy.py; a what-if)",
    )
    e.add_argument(
        "--reserve-shared-prefix",
        action="store_true",
        help="register the prefix common to every prompt as a reserved prefix before the run "
        "(computed once, pinned; the shared-prefix workload, Fig 16)",
    )
    add_engine_args(p)
    if not any("--kv-allocation" in act.option_strings for act in p._actions):
        e.add_argument(
            "--kv-allocation",
            choices=KV_ALLOCATIONS,
            default="paged",
            help="benchmark baselines: orca-* reserve contiguous runs "
            "(streamkv/baselines/contiguous.py)",
        )
    return p


def load_tokenizer(path: str | None):
    from streamkv.models.loader import load_tokenizer as load
    from streamkv.models.loader import resolve_model_dir

    tok = load(resolve_model_dir(path))
    if tok is None:
        raise SystemExit(f"no tokenizer in {path}: pass --tokenizer DIR")
    return tok


def load_requests(path: str) -> list[BenchRequest]:
    with open(path) as f:
        rows = json.load(f)
    try:
        return [
            BenchRequest(
                list(r["prompt_ids"]),
                int(r["output_len"]),
                int(r.get("n", 1)),
                int(r.get("beam_width", 0)),
            )
            for r in rows
        ]
    except (KeyError, TypeError, ValueError) as e:
        raise SystemExit(f"error: {path} is not a --save-workload file ({e})") from None


def make_engine(args: argparse.Namespace):
    from streamkv.entrypoints.args import engine_kwargs
    from streamkv.entrypoints.llm import build_engine, engine_config

    config = engine_config(args.model, **engine_kwargs(args))
    config.cache.kv_allocation = args.kv_allocation
    if args.orca_allocator == "buddy" and args.kv_allocation == "paged":
        raise SystemExit(
            "error: --orca-allocator buddy places an orca-* baseline's runs; paged has none"
        )
    if not args.simulate:
        return _with_allocator(build_engine(config), args), None, None
    from load_tests.sim import SimulatedExecutor, StepCost, VirtualClock

    if args.num_kv_blocks is None:
        raise SystemExit(
            "error: --simulate needs --num-kv-blocks (there is no device to size the pool from)"
        )
    clock = VirtualClock()
    cost = StepCost(
        args.sim_base_ms,
        args.sim_token_ms,
        args.sim_kv_us,
        args.sim_swap_block_us,
        args.sim_swap_token_us,
        args.block_size,
        args.sim_block_us,
    )
    executor = SimulatedExecutor(
        args.model, args.num_kv_blocks, args.num_swap_blocks or 0, cost, clock, args.workload_seed
    )
    return _with_allocator(build_engine(config, executor), args), clock, executor


def _with_allocator(engine, args: argparse.Namespace):
    """Before the first request, the baseline's slot space becomes a buddy allocator of the
    same size (the scheduler and the waste accounting read ``device`` at every step)."""
    if args.orca_allocator == "buddy":
        from load_tests.buddy import BuddyAllocator

        bm = engine.block_manager
        bm.device = BuddyAllocator(bm.device.num_blocks)
    return engine


def reserve_common_prefix(engine, requests: list[BenchRequest]) -> dict:
    """Register the token prefix every prompt shares as a reserved prefix (computed now)."""
    from streamkv.engine.reserved_prefixes import compute_prefixes, register_prefix

    first = requests[0].prompt_ids
    n = min(len(r.prompt_ids) for r in requests)
    for r in requests[1:]:
        n = next((i for i in range(n) if r.prompt_ids[i] != first[i]), n)
    prefix = register_prefix(engine, first[:n])
    compute_prefixes(engine, [prefix])
    return {"tokens": n, "blocks": prefix.num_blocks}


def run_point(args, requests, rate: float, target, recorder=None) -> dict:
    """One rate point: arrivals, the run, its summary, its capacity figures, the engine's KV
    figures and (``recorder``, offline) a sample of its steps."""
    from tqdm import tqdm

    arrivals = arrival_times(len(requests), rate, args.burstiness, seed=args.workload_seed)
    bar = tqdm(
        total=len(requests),
        desc=f"{args.label} @ {rate:g} req/s",
        disable=args.disable_tqdm,
        file=sys.stderr,
        leave=False,
    )
    done = lambda rec: bar.update(1)  # noqa: E731
    busy0 = sim = None
    arrived: list[dict] = []
    if args.backend == "offline":
        from load_tests.offline import run_offline

        engine, clock, sim = target
        before = kv.snapshot_from_stats(engine.stats())
        busy0 = (sim.busy_seconds, sim.seq_seconds) if sim else None
        if recorder is not None:
            recorder.reset()
        records, duration = run_offline(
            engine,
            requests,
            arrivals,
            args.max_duration,
            done,
            clock,
            lambda: arrived.append(kv.snapshot_from_stats(engine.stats())),
            recorder.stepped if recorder is not None else None,
        )
        after = kv.snapshot_from_stats(engine.stats())
    else:
        before = scrape(args.url)
        records, duration = asyncio.run(_serve(args, target, requests, arrivals, done))
        after = scrape(args.url)
    bar.close()
    summary = summarize(records, duration, parse_slo(args.goodput))
    window = kv.window(before, after)
    if args.backend == "offline" and arrived and window is not None:
        # While requests still arrive (the steady load of a long trace; a bounded run's tail
        # is the queue draining, with fewer and fewer requests batched).
        window["while_arriving"] = kv.window(before, arrived[0])
    if busy0 is not None and window is not None:
        busy, weighted = sim.busy_seconds - busy0[0], sim.seq_seconds - busy0[1]
        # Sequences, weighted by step time (the simulated clock); = requests without n / beams.
        window["time_avg_batched_seqs"] = weighted / busy if busy else None
    run = {
        "request_rate": rate,
        "burstiness": args.burstiness,
        "summary": summary,
        "capacity": capacity.figures(records),
        "kv": window,
        "label": args.label,
    }
    if recorder is not None:
        run["steps"] = recorder.as_dict()
    return run


async def _serve(args, tokenizer, requests, arrivals, done):
    from load_tests.drivers import OpenAIDriver, WebSocketDriver
    from load_tests.runner import run_open_loop

    if args.backend == "openai":
        driver = OpenAIDriver(args.url, args.api_key)
    else:
        driver = WebSocketDriver(args.url, tokenizer, args.api_key, args.ws_per_socket)
    try:
        return await run_open_loop(driver, requests, arrivals, args.max_duration, done)
    finally:
        await driver.close()


def scrape(url: str) -> dict | None:
    import httpx

    from load_tests.drivers import loopback_only

    return kv.snapshot_from_metrics(httpx.get(f"{loopback_only(url)}/metrics", timeout=30).text)


def hardware() -> dict:
    info = {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rates = _check_args(args)
    if args.backend != "offline":
        from load_tests.drivers import loopback_only

        args.url = loopback_only(args.url)
    tokenizer = (
        load_tokenizer(args.tokenizer)
        if args.workload_file is None or args.backend == "websocket"
        else None
    )
    requests = _workload(args, tokenizer)
    if args.save_workload is not None:
        _write(args.save_workload, [asdict(r) for r in requests])
        print(f"wrote {len(requests)} {args.workload} requests to {args.save_workload}")
        return 0
    target = make_engine(args) if args.backend == "offline" else tokenizer
    recorder = None
    if args.record_steps > 0 and args.backend == "offline":
        from load_tests.steps import StepRecorder

        recorder = StepRecorder(target[0].info().block_size, args.record_steps, args.workload_seed)
        recorder.attach(target[0].executor)
    if args.reserve_shared_prefix:
        if args.backend != "offline":
            raise SystemExit(
                "error: --reserve-shared-prefix registers on the offline engine: a server takes "
                "POST /v1/prefixes"
            )
        args.reserved_prefix_info = reserve_common_prefix(target[0], requests)
    if args.label is None:
        args.label = (
            args.kv_allocation
            if args.backend == "offline"
            else (scrape(args.url) or {}).get("kv_allocation") or "server"
        )
    result = {
        "label": args.label,
        "backend": args.backend + (" (simulated model)" if args.simulate else ""),
        "workload": args.workload,
        "args": {k: v for k, v in vars(args).items() if k != "api_key"},
        "hardware": hardware(),
        "runs": [],
    }
    if args.append and os.path.exists(args.json_out):
        result["runs"] = _earlier_runs(args.json_out, result, rates)
    try:
        for rate in rates:
            run = run_point(args, requests, rate, target, recorder)
            result["runs"].append(run)
            if args.point_dir:
                point = capacity.point(result, run, args, args.figure)
                print(f"wrote {capacity.write_point(args.point_dir, point)}")
            result["runs"].sort(key=lambda r: r["request_rate"])
            print(format_summary(run), flush=True)
            _write(args.json_out, result)  # after every point: a long sweep keeps what it measured
    finally:
        if args.backend == "offline":
            target[0].shutdown()
    if args.plot:
        plot_latency([result], args.plot, title=f"{args.workload}: {args.label}")
    return 1 if any(r["summary"]["completed"] == 0 for r in result["runs"]) else 0


def _check_args(args) -> list[float]:
    """The request rates, once every flag is checked (SystemExit names a bad one)."""
    try:
        rates = parse_rates(args.request_rate)
        parse_slo(args.goodput)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if not 1 <= args.num_requests <= MAX_REQUESTS:
        raise SystemExit(f"error: --num-requests must be in [1, {MAX_REQUESTS}]")
    if not 0 < args.max_duration <= MAX_DURATION:
        raise SystemExit(f"error: --max-duration must be in (0, {MAX_DURATION:.0f}] seconds")
    if args.simulate and args.backend != "offline":
        raise SystemExit("error: --simulate runs the offline engine: add --backend offline")
    return rates


def _workload(args, tokenizer) -> list[BenchRequest]:
    """The requests: the first --num-requests of --workload-file, or built for --workload."""
    if args.workload_file is None:
        return build(
            args.workload,
            tokenizer,
            args.num_requests,
            args.workload_seed,
            args.n,
            args.beam_width,
            args.length_scale,
            args.max_len,
            args.prefix_len,
        )
    requests = load_requests(args.workload_file)[: args.num_requests]
    if args.n != 1 or args.beam_width:  # the flags override what the file holds
        for r in requests:
            r.n, r.beam_width = (
                (args.beam_width, args.beam_width) if args.beam_width else (args.n, 0)
            )
    return requests


def _earlier_runs(path: str, result: dict, rates: list[float]) -> list[dict]:
    """--append: the runs ``path`` holds at rates other than ``rates``; it must hold the same
    label on the same workload."""
    with open(path) as f:
        old = json.load(f)
    if (old["label"], old["workload"]) != (result["label"], result["workload"]):
        raise SystemExit(
            f"error: {path} holds {old['label']} on {old['workload']}, not "
            f"{result['label']} on {result['workload']}"
        )
    return [r for r in old["runs"] if r["request_rate"] not in rates]


def _write(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
