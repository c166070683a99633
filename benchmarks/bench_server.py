"""Server overhead: output tokens/s of N concurrent streaming clients of ``streamkv serve``
against the same requests through the offline engine (``LLM.generate``), in the same run,
plus the server's event-loop lag under that load. Prints a table and writes JSON.

The offline engine and the server each run in a subprocess (the server on 127.0.0.1; the
clients are httpx streams in this process); offline and server runs alternate for
``--rounds`` rounds and the medians are compared, since run-to-run drift is large. Requests are random token-id prompts with ``ignore_eos`` and greedy decoding, so
both sides produce the same number of tokens (and, greedy, the same tokens).

    python benchmarks/bench_server.py --num-requests 32 --input-len 128 --output-len 256 \\
        --json-out bench_results/server.json
    python benchmarks/bench_server.py --model ./dir --load-format dummy --device cuda ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ENGINE_FLAGS = ("device", "dtype", "load_format", "block_size", "num_kv_blocks", "num_swap_blocks",
                "max_num_seqs", "max_model_len", "seed", "tensor_parallel_size", "distributed_executor_backend")


def engine_kwargs(args) -> dict:
    return {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}


def engine_cli(args) -> list[str]:
    out = []
    for k, v in engine_kwargs(args).items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def make_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Stay clear of the low ids, where tokenizers keep their special tokens.
    return [[rng.randrange(1000, vocab) for _ in range(length)] for _ in range(n)]


def run_offline(llm, prompts, output_len: int) -> tuple[float, int]:
    from streamkv import SamplingParams

    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=output_len)
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int, log):
    cmd = [sys.executable, "-m", "streamkv.entrypoints.cli", "--log-level", "WARNING", "serve",
           *([args.model] if args.model else []), "--host", "127.0.0.1", "--port", str(port),
           "--no-access-log", *engine_cli(args)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    import httpx

    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; log: {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not become healthy; log: {log.name}")


def scrape(url: str) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        m = re.match(r"^streamkv:event_loop_lag_seconds_bucket\{.*le=\"([^\"]+)\".*\} (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of ``pid`` (Linux /proc; empty elsewhere)."""
    out = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        pass
    return out


def histogram_quantile(before: dict, after: dict, q: float) -> float:
    """Prometheus-style quantile of the observations made between two scrapes (linear
    inside a bucket)."""
    bounds = sorted((float("inf") if k == "+Inf" else float(k), after[k] - before.get(k, 0.0)) for k in after)
    total = bounds[-1][1]
    if total <= 0:
        return 0.0
    rank, lo, below = q * total, 0.0, 0.0
    for hi, count in bounds:
        if count >= rank:
            if hi == float("inf"):
                return lo
            return lo + (hi - lo) * (rank - below) / max(count - below, 1e-12)
        lo, below = hi, count
    return lo


async def one_client(client, prompt: list[int], output_len: int, t0: float) -> dict:
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    times, usage = [], None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"]:
                times.append(time.perf_counter() - t0)
    return {"times": times, "completion_tokens": usage["completion_tokens"]}


async def run_clients(url: str, prompts, output_len: int) -> tuple[float, list[dict]]:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_client(client, p, output_len, t0) for p in prompts))
        return time.perf_counter() - t0, results


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def offline_worker(args) -> int:
    """``--offline-worker``: load the engine, say the vocabulary size, then run all requests
    once per line read from stdin, answering one JSON line each."""
    from streamkv.entrypoints.llm import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    vocab = llm.engine.executor.hf_config["vocab_size"]
    prompts = make_prompts(vocab, args.num_requests, args.input_len, seed=args.seed or 0)
    run_offline(llm, prompts[:2], 8)  # warm-up (kernel builds, allocator)
    print(json.dumps({"vocab": vocab}), flush=True)
    for _ in sys.stdin:
        cpu = time.thread_time()
        t, n = run_offline(llm, prompts, args.output_len)
        print(json.dumps({"seconds": t, "tokens": n, "cpu_s": time.thread_time() - cpu}), flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="as for `streamkv serve` (default: the embedded model)")
    ap.add_argument("--num-requests", type=int, default=32, help="= concurrent streaming clients")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    for flag in ENGINE_FLAGS:
        ap.add_argument(f"--{flag.replace('_', '-')}", type=int if flag in (
            "block_size", "num_kv_blocks", "num_swap_blocks", "max_num_seqs", "max_model_len", "seed",
            "tensor_parallel_size") else str)
    ap.add_argument("--rounds", type=int, default=3, help="offline/server pairs; medians are reported")
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--json-out", default="bench_results/server.json")
    ap.add_argument("--offline-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.offline_worker:
        return offline_worker(args)
    import httpx

    # The offline engine runs in a process of its own too, so that each side has one CUDA
    # context and one process's interpreter, and this process only drives the clients.
    worker = subprocess.Popen([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--offline-worker"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def offline_round() -> dict:
        worker.stdin.write("go\n")
        worker.stdin.flush()
        return json.loads(worker.stdout.readline())

    vocab = json.loads(worker.stdout.readline())["vocab"]
    prompts = make_prompts(vocab, args.num_requests, args.input_len, seed=args.seed or 0)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w", prefix="bench-server-", suffix=".log", delete=False)
    proc = start_server(args, port, log)
    rounds = []  # alternate offline and server runs: drift hits both alike
    try:
        httpx.post(f"{url}/v1/completions", json={"prompt": prompts[0][:8], "max_tokens": 8}, timeout=600)
        asyncio.run(run_clients(url, prompts[:2], 8))  # warm-up
        for _ in range(args.rounds):
            off = offline_round()
            t_off, n_off = off["seconds"], off["tokens"]
            before, cpu0 = scrape(url), thread_cpu(proc.pid)
            t_srv, results = asyncio.run(run_clients(url, prompts, args.output_len))
            after, cpu1 = scrape(url), thread_cpu(proc.pid)
            n_srv = sum(r["completion_tokens"] for r in results)
            n_chunks = sum(len(r["times"]) for r in results)
            # The server's main thread runs the event loop; its busiest other thread is the engine.
            loop_cpu = cpu1.get(proc.pid, 0.0) - cpu0.get(proc.pid, 0.0)
            engine_cpu = max((v - cpu0.get(k, 0.0) for k, v in cpu1.items() if k != proc.pid), default=0.0)
            rounds.append({
                "offline_s": t_off, "offline_tok_s": n_off / t_off, "offline_cpu_s": off["cpu_s"], "server_s": t_srv, "server_tok_s": n_srv / t_srv,
                "lag_p50_ms": histogram_quantile(before, after, 0.5) * 1e3,
                "lag_p99_ms": histogram_quantile(before, after, 0.99) * 1e3,
                "loop_cpu_s": loop_cpu, "engine_cpu_s": engine_cpu, "chunks": n_chunks,
                "loop_us_per_chunk": loop_cpu / max(n_chunks, 1) * 1e6,
                "ttft": [r["times"][0] for r in results if r["times"]],
                "itl": [b - a for r in results for a, b in zip(r["times"], r["times"][1:], strict=False)],
            })
    finally:
        proc.terminate()
        proc.wait(30)
        worker.stdin.close()
        worker.wait(60)

    med = {k: statistics.median(r[k] for r in rounds) for k in
           ("offline_tok_s", "server_tok_s", "lag_p50_ms", "lag_p99_ms", "loop_cpu_s", "engine_cpu_s",
            "loop_us_per_chunk", "offline_cpu_s")}
    ratio = med["server_tok_s"] / med["offline_tok_s"]
    ttft = [x for r in rounds for x in r.pop("ttft")]
    itl = [x for r in rounds for x in r.pop("itl")]
    print(f"\n{len(prompts)} requests x {args.input_len} prompt tokens -> {args.output_len} output tokens "
          f"(greedy, ignore_eos), {args.rounds} rounds; engine: {engine_kwargs(args)}")
    print(f"{'round':<7}{'offline s':>11}{'offline tok/s':>15}{'server s':>10}{'server tok/s':>14}{'ratio':>8}"
          f"{'lag p50 ms':>12}{'lag p99 ms':>12}")
    for i, r in enumerate(rounds):
        print(f"{i:<7}{r['offline_s']:>11.2f}{r['offline_tok_s']:>15.1f}{r['server_s']:>10.2f}{r['server_tok_s']:>14.1f}"
              f"{r['server_tok_s'] / r['offline_tok_s']:>8.3f}{r['lag_p50_ms']:>12.2f}{r['lag_p99_ms']:>12.2f}")
    print(f"{'median':<7}{'':>11}{med['offline_tok_s']:>15.1f}{'':>10}{med['server_tok_s']:>14.1f}{ratio:>8.3f}"
          f"{med['lag_p50_ms']:>12.2f}{med['lag_p99_ms']:>12.2f}")
    print(f"server / offline (medians) = {ratio:.3f}x; event-loop lag from the server's "
          f"streamkv:event_loop_lag_seconds histogram")
    print(f"server CPU per run (medians): event-loop thread {med['loop_cpu_s']:.2f} s "
          f"({med['loop_us_per_chunk']:.0f} us per streamed chunk), engine thread {med['engine_cpu_s']:.2f} s; "
          f"offline engine thread {med['offline_cpu_s']:.2f} s")
    print(f"client TTFT p50 {pct(ttft, 0.5) * 1e3:.0f} ms, p99 {pct(ttft, 0.99) * 1e3:.0f} ms; "
          f"inter-chunk p50 {pct(itl, 0.5) * 1e3:.1f} ms, p99 {pct(itl, 0.99) * 1e3:.1f} ms")
    result = {
        "args": vars(args), "rounds": rounds, "median": med, "ratio_server_vs_offline": ratio,
        "client_ttft_ms": {"p50": pct(ttft, 0.5) * 1e3, "p99": pct(ttft, 0.99) * 1e3},
        "client_inter_chunk_ms": {"p50": pct(itl, 0.5) * 1e3, "p99": pct(itl, 0.99) * 1e3},
        "server_log": log.name,
    }
    os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
