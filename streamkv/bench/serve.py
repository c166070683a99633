"""``streamkv bench serve``: the serving benchmark in the standard form: `streamkv serve`
driven with streaming completions from a data set at a request rate (inf = all at once, or
Poisson / gamma arrivals), printing the figures of vLLM's `benchmark_serving` (successful
requests, duration, request / output / total throughput, TTFT / TPOT / ITL mean, median and
p99, goodput under --goodput), and with --offline the offline engine (`LLM.generate`) on the
same requests in the same call, so the served / offline ratio is measured, not assumed.

    # a ShareGPT sample as text prompts (on a box with the data set and a tokenizer)
    streamkv bench serve --save-dataset bench_inputs/sharegpt_serve.json --num-prompts 2000
    # the burst of vLLM's default call, then a Poisson sweep, beside the offline engine
    streamkv bench serve --model llama3-8b --dataset-file bench_inputs/sharegpt_serve.json \\
        --engine-args "--tokenizer DIR --load-format dummy --device cuda --dtype bfloat16" \\
        --num-prompts 1000 --request-rate inf,16,32 --goodput ttft:1000 tpot:50 --offline \\
        --json-out r.json

The server and the offline engine run one after the other in processes of their own (each
claims the GPU's memory); this process only drives the clients (serve_client.py) and watches
the server (server_process.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import resource
import shlex
import signal
import subprocess
import sys
import time

from streamkv.bench.arrivals import arrival_times, parse_rates
from streamkv.bench.serve_client import parse_goodput, print_summary, run_load, summarize
from streamkv.bench.server_process import (
    kv_blocks_in_use,
    model_name,
    profile_later,
    rss_mib,
    start_server,
    thread_cpu,
)


def raise_fd_limit() -> None:
    """One socket per stream: thousands of them need more than the usual 1,024 descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard)
        )


def offline_worker(args, requests) -> int:
    """``--offline-worker``: the same requests through ``LLM.generate``; one JSON line out."""
    from streamkv import LLM, SamplingParams
    from streamkv.entrypoints.args import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    flags = engine_kwargs(p.parse_args(shlex.split(args.engine_args)))
    llm = LLM(args.model, **{k: v for k, v in flags.items() if v is not None})
    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o) for _, _, o in requests
    ]
    llm.generate([r[0] for r in requests[:4]], params[:4], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate([r[0] for r in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    figures = {
        "seconds": seconds,
        "output_tokens": tokens,
        "output_throughput": tokens / seconds,
        "max_num_batched_tokens": llm.engine.config.scheduler.max_num_batched_tokens,
    }
    print("OFFLINE " + json.dumps(figures), flush=True)
    llm.shutdown()
    return 0


def run_offline(args, argv: list[str]) -> dict:
    cmd = [sys.executable, "-m", "streamkv.bench.serve", *argv, "--offline-worker"]
    proc = subprocess.run(
        cmd, stdout=subprocess.PIPE, text=True, timeout=args.startup_timeout + 3600
    )
    for line in proc.stdout.splitlines():
        if line.startswith("OFFLINE "):
            return json.loads(line[8:])
    raise RuntimeError(f"the offline run failed (exit {proc.returncode}): {proc.stdout[-2000:]}")


def add_target_args(ap: argparse.ArgumentParser) -> None:
    """What is measured: the model, the engine and server flags, or a server already up."""
    ap.add_argument(
        "--model", default=None, help="as for `streamkv serve` (default: the embedded model)"
    )
    ap.add_argument(
        "--engine-args",
        default="",
        help="engine flags, given to the server and the offline engine alike",
    )
    ap.add_argument(
        "--server-args", default="", help="flags for the server only (e.g. --max-queue-len 100)"
    )
    ap.add_argument(
        "--server-tree",
        default=None,
        help="run the server from this checkout (e.g. the tree "
        "before a change, unpacked with `git archive`)",
    )
    ap.add_argument(
        "--base-url", default=None, help="drive a server already running there (no --offline)"
    )


def add_load_args(ap: argparse.ArgumentParser) -> None:
    """The load: which requests, at what rates, judged against which SLOs."""
    ap.add_argument(
        "--dataset-file",
        default=None,
        help="JSON [[prompt text, prompt tokens, output tokens], ...]",
    )
    ap.add_argument("--save-dataset", default=None, help="sample ShareGPT into this file and exit")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument(
        "--request-rate", default="inf", help="comma list of req/s; inf = every request at once"
    )
    ap.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)"
    )
    ap.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests in flight (default: no limit)",
    )
    ap.add_argument(
        "--goodput",
        nargs="*",
        default=["ttft:1000", "tpot:50"],
        help="SLOs: ttft:MS tpot:MS e2el:MS",
    )
    ap.add_argument(
        "--offline", action="store_true", help="the offline engine on the same requests, same call"
    )
    ap.add_argument("--seed", type=int, default=0)


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """How the run is watched and where its figures go."""
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument(
        "--server-log", default=None, help="the server's log (default: a temporary file)"
    )
    ap.add_argument(
        "--py-spy", default=None, metavar="PREFIX", help="py-spy the server during the first rate"
    )
    ap.add_argument("--py-spy-delay", type=float, default=15.0)
    ap.add_argument("--py-spy-seconds", type=float, default=15.0)
    ap.add_argument("--json-out", default="bench_results/serve.json")
    ap.add_argument("--offline-worker", action="store_true", help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="streamkv bench serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_target_args(ap)
    add_load_args(ap)
    add_run_args(ap)
    return ap


def measure_rate(args, url: str, name: str, proc, requests, rate: float, slo) -> dict:
    """One rate's summary; with a server of our own, its memory and per-thread CPU too."""
    cpu0 = thread_cpu(proc.pid) if proc else {}
    times = arrival_times(len(requests), rate, args.burstiness, args.seed)
    load = run_load(url, name, requests, times, max_concurrency=args.max_concurrency)
    duration, results = asyncio.run(load)
    s = summarize(duration, results, slo)
    s["request_rate"] = rate if math.isfinite(rate) else "inf"
    if proc:
        cpu1 = thread_cpu(proc.pid)
        busy = sorted((v - cpu0.get(k, 0.0) for k, v in cpu1.items()), reverse=True)
        s["server_rss_mib"] = rss_mib(proc.pid)
        s["server_loop_cpu_s"] = cpu1.get(proc.pid, 0.0) - cpu0.get(proc.pid, 0.0)
        s["server_busiest_threads_cpu_s"] = busy[:3]
    return s


def print_rate(rate: float, s: dict, proc) -> None:
    print_summary(rate, s)
    if "served_over_offline" in s:
        print(f"{'Served / offline output tok/s:':<42}{s['served_over_offline']:>12.3f}")
    if proc:
        busiest = [round(x, 1) for x in s["server_busiest_threads_cpu_s"]]
        print(
            f"server RSS {s['server_rss_mib']:.0f} MiB; event-loop thread "
            f"{s['server_loop_cpu_s']:.1f} CPU s, busiest threads {busiest} CPU s",
            flush=True,
        )


def run_rates(args, url: str, proc, requests, rates, slo, offline: dict | None) -> list[dict]:
    """Every rate in turn on one server, after a 4-request warm-up; py-spy watches the first."""
    name = model_name(url)
    asyncio.run(run_load(url, name, requests[:4], [0.0] * 4))  # warm-up
    summaries = []
    for i, rate in enumerate(rates):
        spy = profile_later(args, proc.pid) if proc and i == 0 else None
        s = measure_rate(args, url, name, proc, requests, rate, slo)
        if offline is not None:
            s["served_over_offline"] = s["output_throughput"] / offline["output_throughput"]
        print_rate(rate, s, proc)
        time.sleep(1.0)  # the last aborts and frees reach the engine thread
        s["kv_cache_usage_after"] = kv_blocks_in_use(url)
        print(f"{'KV cache usage after the run:':<42}{s['kv_cache_usage_after']:>12}", flush=True)
        summaries.append(s)
        if spy is not None:
            spy.join()
    return summaries


def stop_server(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def print_table(summaries: list[dict]) -> None:
    """One line per rate, so a sweep reads at a glance."""
    print(
        f"\n{'rate':>6}{'ok':>6}{'fail':>6}{'out tok/s':>11}"
        f"{'ratio':>7}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'TPOT p50':>10}{'TPOT p99':>10}{'ITL p99':>9}{'goodput':>9}"
    )
    for s in summaries:
        print(
            f"{s['request_rate']!s:>6}{s['completed']:>6}{s['failed']:>6}"
            f"{s['output_throughput']:>11.1f}"
            f"{s.get('served_over_offline', math.nan):>7.3f}"
            f"{s['median_ttft_ms']:>10.1f}{s['p99_ttft_ms']:>10.1f}"
            f"{s['median_tpot_ms']:>10.2f}{s['p99_tpot_ms']:>10.2f}{s['p99_itl_ms']:>9.1f}"
            f"{s['goodput_req_s'] if s['goodput_req_s'] is not None else math.nan:>9.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.save_dataset:
        from streamkv.bench.sharegpt import save_dataset

        return save_dataset(args)
    if not args.dataset_file:
        ap.error("--dataset-file is required (write one with --save-dataset)")
    with open(args.dataset_file) as f:
        requests = [tuple(r) for r in json.load(f)][: args.num_prompts]
    if args.offline_worker:
        return offline_worker(args, requests)
    raise_fd_limit()
    rates, slo = parse_rates(args.request_rate), parse_goodput(args.goodput)
    result: dict = {"args": vars(args), "num_prompts": len(requests), "rates": []}
    if args.offline:
        off = result["offline"] = run_offline(args, argv)
        print(
            f"offline engine: {off['output_throughput']:.1f} output tok/s ({off['seconds']:.1f} s)",
            flush=True,
        )
    log = open(args.server_log or f"/tmp/bench-serve-{os.getpid()}.log", "w")  # noqa: SIM115
    proc = None
    if args.base_url:
        url = args.base_url.rstrip("/")
    else:
        proc, url = start_server(args, log)
    try:
        result["rates"] = run_rates(args, url, proc, requests, rates, slo, result.get("offline"))
    finally:
        if proc is not None:
            stop_server(proc)
        log.close()
    with open(log.name) as f:  # the server's periodic stats lines: running / waiting over the run
        result["server_stats"] = [line.strip() for line in f if "streamkv.stats" in line][-400:]
    print_table(result["rates"])
    os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
