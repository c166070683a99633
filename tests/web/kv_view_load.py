"""What watching the KV cache costs (issue 16: < 2% of tokens/s with 5 viewers), measured so
that a noisy shared machine can still answer.

One server; many short phases of the same fixed work (``--requests`` streamed requests,
``--concurrency`` at a time, ``--max-tokens`` each), alternately without and with
``--viewers`` readers of /v1/kv/stream, in ABBA order (off on, on off, ...) so a linear
drift of the machine cancels. Adjacent phases form a pair; per pair the ratio with/without
of tokens/s and of the server's CPU seconds per generated token (/proc, all threads, and
split: main thread = the event loop, the rest = the engine thread). Reported: the ratio of
medians and the median of the per-pair ratios, each with a paired bootstrap 95% interval
(pairs resampled), and the engine-thread share the snapshots took (the ``cost_ms`` each
message reports). The verdict says whether the interval excludes a 2% slowdown.

    .venv/bin/python -m tests.web.kv_view_load --viewers 5 --pairs 24 --out kv_view_load.json
    .venv/bin/python -m tests.web.kv_view_load --micro    # one snapshot of a large pool, timed
    # py-spy: where the server's time goes
    .venv/bin/python -m tests.web.kv_view_load --profile PY_SPY

Not a pytest module (the name does not start with test_): it takes minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import time

import httpx
import numpy as np

from tests.entrypoints.conftest import run_server

BUDGET = 0.02  # the bound: viewers may cost < 2% of tokens/s


async def one_request(client: httpx.AsyncClient, max_tokens: int) -> int:
    body = {
        "prompt": "Once upon a time, in a city by the sea,",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"usage":{' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    return tokens


async def load(
    client: httpx.AsyncClient, concurrency: int, requests: int, max_tokens: int
) -> tuple[int, float]:
    """Completion tokens of ``requests`` streamed requests, ``concurrency`` at a time, and the
    seconds taken."""
    sem = asyncio.Semaphore(concurrency)

    async def run() -> int:
        async with sem:
            return await one_request(client, max_tokens)

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(run() for _ in range(requests))))
    return tokens, time.perf_counter() - t0


async def viewer(url: str, costs: list[float], size: list[int]) -> None:
    """Reads the snapshot stream until cancelled, as cheaply as it can (this client shares
    the machine's two cores with the server), counting the bytes read into ``size[0]``."""
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        async with client.stream("GET", "/v1/kv/stream") as r:
            async for line in r.aiter_lines():
                size[0] += len(line)
                if line.startswith("data:") and '"cost_ms":' in line:
                    costs.append(float(line.split('"cost_ms":', 1)[1].split(",", 1)[0]))


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of a process's main thread and of all its other threads
    (Linux)."""
    main = rest = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # a thread that just ended
            continue
        seconds = (int(fields[11]) + int(fields[12])) / tick
        if int(tid) == pid:
            main += seconds
        else:
            rest += seconds
    return {"main": main, "rest": rest}


def _client_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def phase(server, client: httpx.AsyncClient, viewers: int, args) -> dict:
    costs, size = [], [0]
    tasks = [asyncio.create_task(viewer(server.url, costs, size)) for _ in range(viewers)]
    await asyncio.sleep(args.settle)  # both arms wait alike; viewers connect meanwhile
    cpu0, me0 = thread_cpu(server.proc.pid), _client_cpu()
    tokens, seconds = await load(client, args.concurrency, args.requests, args.max_tokens)
    cpu1, me1 = thread_cpu(server.proc.pid), _client_cpu()
    for task in tasks:  # an idle engine sends nothing new: do not wait for the next keep-alive
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    # Every viewer reports every snapshot's cost; the producer takes one for all of them.
    engine_s = sum(costs) / 1000 / viewers if viewers else 0.0
    return {
        "viewers": viewers,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "cpu_ms_per_token": 1000 * sum(cpu1[k] - cpu0[k] for k in cpu0) / tokens,
        "main_cpu_ms_per_token": 1000 * (cpu1["main"] - cpu0["main"]) / tokens,
        "engine_cpu_ms_per_token": 1000 * (cpu1["rest"] - cpu0["rest"]) / tokens,
        "client_cpu_s": me1 - me0,
        "snapshots": len(costs) / viewers if viewers else 0,
        "engine_thread_share": engine_s / seconds,
        "bytes_per_viewer_per_s": size[0] / viewers / seconds if viewers else 0.0,
    }


VIEW_CODE = ("kv_view.py", "kv_snapshot.py")  # frames that only run for viewers


def view_share(raw_path: str) -> dict:
    """From py-spy's raw (collapsed) stacks: busy samples per thread (the engine thread's
    stacks pass through async_engine.py), those in the view's code, and those in SSE
    sending (sse_starlette: the viewers' streams and the completions' alike)."""
    counts = dict.fromkeys(("samples", "engine", "view", "engine_view", "sse"), 0)
    with open(raw_path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit():
                continue
            n, in_view, on_engine = (
                int(count),
                any(k in stack for k in VIEW_CODE),
                "async_engine.py" in stack,
            )
            counts["samples"] += n
            counts["engine"] += n * on_engine
            counts["view"] += n * in_view
            counts["engine_view"] += n * (in_view and on_engine)
            counts["sse"] += n * ("sse_starlette" in stack and not in_view)
    return counts


async def _forever(client: httpx.AsyncClient, max_tokens: int) -> None:
    while True:
        await one_request(client, max_tokens)


async def profile(server, client: httpx.AsyncClient, args) -> None:
    """The server sampled by py-spy (``--profile``) under a steady load, without and then
    with the viewers: what share of its busy samples the view's code takes."""
    for n in (0, args.viewers):
        out = f"{args.profile_out}-{n}viewers.txt"
        spy = await asyncio.create_subprocess_exec(
            args.profile,
            "record",
            "--pid",
            str(server.proc.pid),
            "--duration",
            str(args.profile_seconds),
            "--rate",
            "50",
            "--nonblocking",
            "--format",
            "raw",
            "--output",
            out,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        costs, size = [], [0]
        tasks = [asyncio.create_task(viewer(server.url, costs, size)) for _ in range(n)]
        tasks += [
            asyncio.create_task(_forever(client, args.max_tokens)) for _ in range(args.concurrency)
        ]
        await spy.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        r = view_share(out)
        print(
            f"py-spy, {n} viewers: {r['samples']} busy samples ({r['engine']} engine thread): "
            f"{r['view']} in the view's code ({r['engine_view']} on the engine thread), "
            f"{r['sse']} in SSE sending ({out})",
            flush=True,
        )


async def main_async(args) -> list[dict]:
    # One torch thread: then the server's CPU time per token counts work done, not the
    # spin-waiting of idle OpenMP threads, which grows with whatever else the machine runs.
    os.environ["OMP_NUM_THREADS"] = str(args.server_threads)
    with run_server(*args.server_args) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
            await load(client, args.concurrency, args.concurrency, 8)  # warm-up
            if args.profile:
                await profile(server, client, args)
                return []
            pairs = []
            for k in range(args.pairs):
                order = (0, args.viewers) if k % 2 == 0 else (args.viewers, 0)  # ABBA
                try:
                    rows = {n: await phase(server, client, n, args) for n in order}
                except (ProcessLookupError, FileNotFoundError, httpx.HTTPError) as e:
                    # The server went away (on a shared box: killed from outside): keep what was
                    # measured.
                    print(
                        f"pair {k}: the server stopped ({type(e).__name__}: "
                        f"{e}); summarizing {len(pairs)} pairs",
                        flush=True,
                    )
                    break
                pairs.append({"pair": k, "off": rows[0], "on": rows[args.viewers]})
                print(
                    f"pair {k:2d}: tok/s off {rows[0]['tokens_per_s']:.2f}, "
                    f"on {rows[args.viewers]['tokens_per_s']:.2f}; "
                    f"server CPU ms/token off {rows[0]['cpu_ms_per_token']:.1f}, "
                    f"on {rows[args.viewers]['cpu_ms_per_token']:.1f}",
                    flush=True,
                )
        return pairs


def paired_ratios(off: np.ndarray, on: np.ndarray, draws: int = 5000, seed: int = 0) -> dict:
    """on ÷ off two ways, each with a 95% interval from resampling the pairs: the ratio of
    the medians, and the median of the per-pair ratios (drift within a pair cancels)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(off), size=(draws, len(off)))
    of_medians = np.median(on[idx], axis=1) / np.median(off[idx], axis=1)
    per_pair = on / off
    of_pairs = np.median(per_pair[idx], axis=1)
    return {
        "ratio_of_medians": float(np.median(on) / np.median(off)),
        "ratio_of_medians_ci": [float(x) for x in np.percentile(of_medians, [2.5, 97.5])],
        "median_pair_ratio": float(np.median(per_pair)),
        "median_pair_ratio_ci": [float(x) for x in np.percentile(of_pairs, [2.5, 97.5])],
        "pairs": len(off),
    }


def verdict(tps: dict) -> str:
    """Read on the tokens/s median pair ratio's interval against the 2% budget."""
    lo, hi = tps["median_pair_ratio_ci"]
    if lo > 1 - BUDGET:
        return f"cost < {BUDGET:.0%} shown (the whole interval is above {1 - BUDGET:.2f})"
    if hi < 1 - BUDGET:
        return f"cost > {BUDGET:.0%} shown (the whole interval is below {1 - BUDGET:.2f})"
    return f"not resolved: the interval [{lo:.3f}, {hi:.3f}] straddles {1 - BUDGET:.2f}"


def summarize(pairs: list[dict]) -> dict:
    get = lambda key, arm: np.array([p[arm][key] for p in pairs])  # noqa: E731
    out = {
        key: paired_ratios(get(key, "off"), get(key, "on"))
        for key in (
            "tokens_per_s",
            "cpu_ms_per_token",
            "main_cpu_ms_per_token",
            "engine_cpu_ms_per_token",
        )
    }
    on = [p["on"] for p in pairs]
    out["engine_thread_share"] = float(np.median([r["engine_thread_share"] for r in on]))
    out["snapshots_per_s"] = float(np.median([r["snapshots"] / r["seconds"] for r in on]))
    out["kib_per_viewer_per_s"] = float(np.median([r["bytes_per_viewer_per_s"] for r in on])) / 1024
    out["client_cpu_s_per_phase"] = {
        arm: float(np.median(get("client_cpu_s", arm))) for arm in ("off", "on")
    }
    out["verdict"] = verdict(out["tokens_per_s"])
    return out


def report(s: dict, pairs: list[dict], viewers: int) -> str:
    lines = [
        f"| measure (with {viewers} viewers ÷ without) | "
        "median off | median on | ratio of medians [95% CI] "
        f"| median pair ratio [95% CI] |",
        "|---|---|---|---|---|",
    ]
    for key, name in (
        ("tokens_per_s", "tokens/s"),
        ("cpu_ms_per_token", "server CPU ms/token"),
        ("main_cpu_ms_per_token", "  main thread (event loop)"),
        ("engine_cpu_ms_per_token", "  other threads (engine)"),
    ):
        r = s[key]
        off = np.median([p["off"][key] for p in pairs])
        on = np.median([p["on"][key] for p in pairs])
        lines.append(
            f"| {name} | {off:.3f} | {on:.3f} | {r['ratio_of_medians']:.4f} "
            f"[{r['ratio_of_medians_ci'][0]:.4f}, {r['ratio_of_medians_ci'][1]:.4f}] "
            f"| {r['median_pair_ratio']:.4f} [{r['median_pair_ratio_ci'][0]:.4f}, "
            f"{r['median_pair_ratio_ci'][1]:.4f}] |"
        )
    lines.append(
        f"\n{s['tokens_per_s']['pairs']} pairs; snapshots {s['snapshots_per_s']:.1f}/s taking "
        f"{100 * s['engine_thread_share']:.3f} % of the "
        f"engine thread; {s['kib_per_viewer_per_s']:.1f} KiB/s "
        f"per viewer; this client's CPU per phase {s['client_cpu_s_per_phase']['off']:.2f} s off, "
        f"{s['client_cpu_s_per_phase']['on']:.2f} s on"
    )
    lines.append(f"verdict (tokens/s): {s['verdict']}")
    return "\n".join(lines)


def micro(num_blocks: int, num_seqs: int, tokens: int, repeat: int = 50) -> None:
    """Engine-thread cost of one snapshot (take + as_dict) of a pool, without a server."""
    from streamkv.config import SchedulerConfig
    from streamkv.core.block_manager import BlockManager
    from streamkv.core.kv_snapshot import take_snapshot
    from streamkv.core.scheduler import Scheduler
    from streamkv.sampling_params import SamplingParams
    from streamkv.sequence import Sequence, SequenceGroup

    bm = BlockManager(16, num_blocks, 4096, enable_prefix_caching=True, watermark=0.0)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=num_seqs * tokens), bm
    )
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
    print(
        f"{num_blocks} blocks, {len(sched.running)} sequences "
        f"of {tokens} tokens ({bm.device.num_used} blocks used): "
        f"snapshot min {1e3 * times[0]:.2f} ms, median "
        f"{1e3 * times[len(times) // 2]:.2f} ms; {size} bytes of JSON"
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--viewers", type=int, default=5)
    p.add_argument(
        "--pairs",
        "--rounds",
        type=int,
        default=24,
        dest="pairs",
        help="off/on pairs of phases, ABBA order (--rounds: the name in older docs)",
    )
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=8, help="requests per phase")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument(
        "--settle", type=float, default=0.5, help="seconds before each phase's timed work"
    )
    p.add_argument(
        "--server-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="extra `streamkv serve` flags: everything after it (so last)",
    )
    p.add_argument("--server-threads", type=int, default=1, help="OMP_NUM_THREADS of the server")
    p.add_argument("--out", default=None, help="write the pairs and the summary as JSON here")
    p.add_argument(
        "--micro", action="store_true", help="only time one snapshot of a 32k-block pool"
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="PY_SPY",
        help="instead of the A/B: sample the server with this py-spy, without and with the viewers",
    )
    p.add_argument("--profile-seconds", type=int, default=40)
    p.add_argument("--profile-out", default="kv_view_profile", help="py-spy raw output prefix")
    args = p.parse_args()
    if args.micro:
        micro(32768, 256, 1024)
        return
    if args.viewers < 1 or args.pairs < 2:
        raise SystemExit("error: --viewers >= 1 and --pairs >= 2")
    pairs = asyncio.run(main_async(args))
    if args.profile:
        return
    s = summarize(pairs)
    print("\n" + report(s, pairs, args.viewers))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "pairs": pairs, "summary": s}, f, indent=1)


if __name__ == "__main__":
    main()
