"""What watching the KV cache costs: server tokens/s under a fixed streaming load with no
viewer and with N viewers of /v1/kv/stream, in alternating rounds on one server; and the
engine-thread time the snapshots took (the ``cost_ms`` each message reports).

    .venv/bin/python -m tests.web.kv_view_load --viewers 5 --rounds 4 --out kv_view_load.json
    .venv/bin/python -m tests.web.kv_view_load --micro    # one snapshot of a large pool, timed

Not a pytest module (the name does not start with test_): it takes minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

import httpx

from tests.entrypoints.conftest import run_server


async def one_request(client: httpx.AsyncClient, max_tokens: int) -> int:
    body = {"prompt": "Once upon a time, in a city by the sea,", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"usage":{' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    return tokens


async def load(url: str, concurrency: int, requests: int, max_tokens: int) -> float:
    """Completion tokens per second of ``requests`` streamed requests, ``concurrency`` at a time."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def run() -> int:
            async with sem:
                return await one_request(client, max_tokens)

        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(run() for _ in range(requests))))
        return tokens / (time.perf_counter() - t0)


async def viewer(url: str, stop: asyncio.Event, costs: list[float]) -> int:
    """Reads the snapshot stream as the page does, until ``stop``; returns the bytes read."""
    size = 0
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        async with client.stream("GET", "/v1/kv/stream") as r:
            async for line in r.aiter_lines():
                size += len(line)
                if line.startswith("data:") and '"cost_ms":' in line:
                    costs.append(float(line.split('"cost_ms":', 1)[1].split(",", 1)[0]))
                if stop.is_set():
                    break
    return size


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def phase(server, viewers: int, args) -> dict:
    url = server.url
    stop, costs = asyncio.Event(), []
    tasks = [asyncio.create_task(viewer(url, stop, costs)) for _ in range(viewers)]
    await asyncio.sleep(0.5 if viewers else 0)
    t0, cpu0 = time.perf_counter(), cpu_seconds(server.proc.pid)
    tps = await load(url, args.concurrency, args.requests, args.max_tokens)
    elapsed = time.perf_counter() - t0
    # CPU time per token hardly depends on what else the machine runs, unlike tokens/s.
    cpu_ms_per_token = 1000 * (cpu_seconds(server.proc.pid) - cpu0) / (tps * elapsed)
    stop.set()
    sizes = await asyncio.gather(*tasks) if tasks else []
    # Each viewer reports every snapshot's cost; the producer takes one for all of them.
    per_viewer = len(costs) / viewers if viewers else 0
    engine_ms = sum(costs) / viewers if viewers else 0.0
    return {"viewers": viewers, "tokens_per_s": tps, "seconds": elapsed, "snapshots": per_viewer,
            "server_cpu_ms_per_token": cpu_ms_per_token,
            "engine_thread_share": engine_ms / 1000 / elapsed if viewers else 0.0,
            "bytes_per_viewer_per_s": (sum(sizes) / viewers / elapsed) if viewers else 0.0}


async def main_async(args) -> list[dict]:
    # One torch thread: then the server's CPU time per token counts work done, not the
    # spin-waiting of idle OpenMP threads, which grows with whatever else the machine runs.
    os.environ["OMP_NUM_THREADS"] = str(args.server_threads)
    with run_server(*args.server_args) as server:
        await load(server.url, args.concurrency, args.concurrency, 8)  # warm up
        results = []
        for r in range(args.rounds):
            order = (0, args.viewers) if r % 2 == 0 else (args.viewers, 0)
            for n in order:
                results.append(await phase(server, n, args))
                print(f"round {r}: {n} viewers: {results[-1]['tokens_per_s']:.2f} tok/s, "
                      f"{results[-1]['server_cpu_ms_per_token']:.1f} server CPU ms per token", flush=True)
        return results


def micro(num_blocks: int, num_seqs: int, tokens: int, repeat: int = 50) -> None:
    """Engine-thread cost of one snapshot (take + as_dict) of a pool, without a server."""
    from streamkv.config import SchedulerConfig
    from streamkv.core.block_manager import BlockManager
    from streamkv.core.kv_snapshot import take_snapshot
    from streamkv.core.scheduler import Scheduler
    from streamkv.sampling_params import SamplingParams
    from streamkv.sequence import Sequence, SequenceGroup

    bm = BlockManager(16, num_blocks, 4096, enable_prefix_caching=True, watermark=0.0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=num_seqs, max_model_len=tokens + 1,
                                      max_num_batched_tokens=num_seqs * tokens), bm)
    for i in range(num_seqs):
        sched.add(SequenceGroup(str(i), [Sequence(i, [i] * tokens)], SamplingParams()))
    for s in sched.schedule().scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
    times, size = [], 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        snap = take_snapshot(bm, sched).as_dict()
        times.append(time.perf_counter() - t0)
        size = len(json.dumps(snap, separators=(",", ":")))
    times.sort()
    print(f"{num_blocks} blocks, {len(sched.running)} sequences of {tokens} tokens ({bm.device.num_used} blocks used): "
          f"snapshot min {1e3 * times[0]:.2f} ms, median {1e3 * times[len(times) // 2]:.2f} ms; {size} bytes of JSON")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--viewers", type=int, default=5)
    p.add_argument("--rounds", type=int, default=4, help="alternating no-viewer / viewer pairs")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=16, help="requests per phase")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--server-args", nargs="*", default=[], help="extra `streamkv serve` flags")
    p.add_argument("--server-threads", type=int, default=1, help="OMP_NUM_THREADS of the server")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--micro", action="store_true", help="only time one snapshot of a 32k-block pool")
    args = p.parse_args()
    if args.micro:
        micro(32768, 256, 1024)
        return
    rows = asyncio.run(main_async(args))
    base = [r["tokens_per_s"] for r in rows if r["viewers"] == 0]
    watched = [r for r in rows if r["viewers"]]
    tps = [r["tokens_per_s"] for r in watched]
    print(f"\n| viewers | tokens/s (median of {len(base)}) | per round |")
    print("| --- | --- | --- |")
    print(f"| 0 | {statistics.median(base):.1f} | {', '.join(f'{x:.1f}' for x in base)} |")
    print(f"| {args.viewers} | {statistics.median(tps):.1f} | {', '.join(f'{x:.1f}' for x in tps)} |")
    change = statistics.median(tps) / statistics.median(base) - 1
    cpu0 = statistics.median(r["server_cpu_ms_per_token"] for r in rows if r["viewers"] == 0)
    cpu1 = statistics.median(r["server_cpu_ms_per_token"] for r in watched)
    print(f"server CPU per token: {cpu0:.2f} ms without viewers, {cpu1:.2f} ms with {args.viewers} "
          f"({100 * (cpu1 / cpu0 - 1):+.2f} %)")
    share = statistics.median(r["engine_thread_share"] for r in watched)
    rate = statistics.median(r["snapshots"] / r["seconds"] for r in watched)
    kib = statistics.median(r["bytes_per_viewer_per_s"] for r in watched) / 1024
    print(f"\ntokens/s with {args.viewers} viewers: {100 * change:+.2f} %; snapshots {rate:.1f}/s, "
          f"{100 * share:.3f} % of the engine thread; {kib:.1f} KiB/s per viewer")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "change": change, "engine_thread_share": share,
                       "cpu_change": cpu1 / cpu0 - 1}, f, indent=1)


if __name__ == "__main__":
    main()
