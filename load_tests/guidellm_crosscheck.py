"""Cross-check of our load harness against a client nobody here wrote: GuideLLM.

Both clients drive the same ``streamkv serve`` (started here on 127.0.0.1 and a fixed port)
with the same workload shape: N requests at a constant rate, each with a P-token prompt and
exactly M output tokens (``ignore_eos``), streamed over ``/v1/completions``. ``--mode
together`` runs both at once, ours half an interval after GuideLLM's arrivals, so both
measure the very same conditions; ``--mode alternate`` runs them one after the other
(GuideLLM, ours, GuideLLM, ours, ...), where the drift of a shared machine shows. Per run
it records each client's own TTFT and ITL medians, and both clients' raw timings recomputed
under one definition, so a disagreement splits into "the clients define it differently"
and "the clients measure differently":

- TTFT. GuideLLM: first streamed token - request start (headers written). Ours: first
  streamed token - *scheduled* arrival (``load_tests/runner.py``: coordinated omission).
- ITL. GuideLLM: per request (last token - first token) / (tokens - 1), then the median over
  requests (token-weighted; all weights equal here). Ours: every gap between successive
  deliveries, pooled over requests, then the median.

    python -m load_tests.guidellm_crosscheck --mode together --pairs 3 --num-requests 24 \\
        --rate 0.2 --prompt-tokens 32 --output-tokens 16 --json-out bench_results/guidellm_crosscheck.json

GuideLLM lives in its own virtualenv (``--guidellm``, default $GUIDELLM or
/tmp/guidellm-venv/bin/guidellm); without it this prints why and exits 0 (CI does not
install it). It gets a local tokenizer directory (the embedded model's, saved here) and
HF_HUB_OFFLINE=1: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_GUIDELLM = "/tmp/guidellm-venv/bin/guidellm"
METRICS = ("ttft_ms", "itl_ms", "ttft_sent_ms", "ttft_sched_ms", "itl_per_request_ms")


def find_guidellm(path: str | None) -> str | None:
    """The guidellm executable, or None where it is not installed."""
    for candidate in (path, os.environ.get("GUIDELLM"), DEFAULT_GUIDELLM, shutil.which("guidellm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


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
        "ttft_sent_ms": _median([1e3 * (t["first_token_iteration"] - t["request_start"]) for t in timings]),
        "ttft_sched_ms": _median([1e3 * (t["first_token_iteration"] - t["targeted_start"]) for t in timings]),
        "itl_per_request_ms": _median([r["inter_token_latency_ms"] for r in done
                                       if r["inter_token_latency_ms"] is not None]),
        "prompt_tokens": statistics.fmean(r["prompt_tokens"] for r in done) if done else float("nan"),
        "output_tokens": statistics.fmean(r["output_tokens"] for r in done) if done else float("nan"),
        "duration_s": bench["duration"],
    }


def harness_figures(records: list, duration: float) -> dict:
    """Our harness's records: its own summary (load_tests/metrics.py), and the same raw
    timings under GuideLLM's definitions."""
    from load_tests.metrics import summarize

    s = summarize(records, duration)
    done = [r for r in records if r.ok and r.chunk_times]
    per_request = [1e3 * (r.chunk_times[-1] - r.chunk_times[0]) / (r.output_tokens - 1)
                   for r in done if r.output_tokens > 1]
    return {
        "completed": s["completed"], "errors": s["errors"],
        "ttft_ms": s["ttft_ms"]["p50"], "itl_ms": s["itl_ms"]["p50"], "tpot_ms": s["tpot_ms"]["p50"],
        "ttft_sent_ms": _median([1e3 * (r.chunk_times[0] - r.sent) for r in done]),
        "ttft_sched_ms": _median([1e3 * (r.chunk_times[0] - r.scheduled) for r in done]),
        "itl_per_request_ms": _median(per_request),
        "prompt_tokens": statistics.fmean(r.prompt_len for r in done) if done else float("nan"),
        "output_tokens": statistics.fmean(r.output_tokens for r in done) if done else float("nan"),
        "duration_s": duration,
    }


def compare(runs: list[dict]) -> dict:
    """Per metric: each client's median over its runs, ours ÷ GuideLLM, and the ratio of
    each adjacent pair (run i of GuideLLM with run i of ours) to show the spread."""
    out = {}
    for m in METRICS:
        g = [r[m] for r in runs if r["client"] == "guidellm"]
        h = [r[m] for r in runs if r["client"] == "harness"]
        pairs = [b / a for a, b in zip(g, h) if a]
        out[m] = {"guidellm": _median(g), "harness": _median(h),
                  "ratio": _median(h) / _median(g) if g and h and _median(g) else float("nan"),
                  "pair_ratios": pairs}
    return out


def format_table(runs: list[dict], summary: dict) -> str:
    head = ("| run | client | done | TTFT p50 (own) | ITL p50 (own) | TTFT from send | TTFT from schedule "
            "| ITL per request | client CPU s | server CPU s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in runs:
        lines.append(f"| {r['pair']} | {r['client']} | {r['completed']} | {r['ttft_ms']:.0f} | {r['itl_ms']:.0f} "
                     f"| {r['ttft_sent_ms']:.0f} | {r['ttft_sched_ms']:.0f} | {r['itl_per_request_ms']:.0f} "
                     f"| {r['client_cpu_s']:.1f} | {r['server_cpu_s']:.1f} |")
    lines += ["", "| metric (ms, median of runs) | GuideLLM | ours | ours ÷ GuideLLM | per pair |", "|---|---|---|---|---|"]
    for m, v in summary.items():
        lines.append(f"| {m} | {v['guidellm']:.0f} | {v['harness']:.0f} | {v['ratio']:.3f} "
                     f"| {', '.join(f'{x:.2f}' for x in v['pair_ratios'])} |")
    return "\n".join(lines)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def serve(args):
    """``streamkv serve`` on 127.0.0.1:``--port`` (the embedded model), until the block ends."""
    import httpx

    env = {**os.environ, "OMP_NUM_THREADS": str(args.server_threads), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "streamkv.entrypoints.cli", "--log-level", "WARNING", "serve", "--host",
           "127.0.0.1", "--port", str(args.port), "--no-access-log", "--device", "cpu", *args.server_args]
    with open(args.server_log, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{args.port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"error: the server exited with {proc.returncode} (log: {args.server_log})")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"error: the server is not healthy after 300 s (log: {args.server_log})")
            time.sleep(0.5)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def synthetic_requests(num: int, prompt_tokens: int, output_tokens: int, vocab: int, seed: int) -> list:
    """Distinct random prompts (no prefix-cache hit, as GuideLLM's distinct synthetic text)."""
    from load_tests.workloads import BenchRequest

    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(1000, vocab) for _ in range(prompt_tokens)], output_tokens)
            for _ in range(num)]


def run_harness(url: str, args, vocab: int, seed: int) -> dict:
    from load_tests.arrivals import arrival_times
    from load_tests.drivers import OpenAIDriver
    from load_tests.runner import run_open_loop

    requests = synthetic_requests(args.num_requests, args.prompt_tokens, args.output_tokens, vocab, seed)
    # Gamma gaps of shape 1e6 are constant intervals in effect (GuideLLM's constant profile);
    # shape 1 is the Poisson process (its poisson profile).
    arrivals = arrival_times(len(requests), args.rate, burstiness=1e6 if args.arrivals == "constant" else 1.0,
                             seed=seed)

    async def go():
        driver = OpenAIDriver(url)
        try:
            return await run_open_loop(driver, requests, arrivals, args.max_duration)
        finally:
            await driver.close()

    records, duration = asyncio.run(go())
    return harness_figures(records, duration)


def start_guidellm(exe: str, url: str, args, tokenizer_dir: str, seed: int, out: Path) -> subprocess.Popen:
    cmd = [exe, "run", "--backend", f"kind=openai_http,target={url},request_format=/v1/completions",
           "--profile", f"kind={args.arrivals},rate={args.rate}",
           "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
           "--data-loader", f"kind=pytorch,samples={args.num_requests},prefetch_factor={args.num_requests}",
           "--tokenizer", f"kind=hf_auto,model={tokenizer_dir}", "--seed", f"kind=static,value={seed}",
           "--constraint", f"kind=max_requests,count={args.num_requests}",
           "--constraint", f"kind=max_duration,seconds={args.max_duration}",
           "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           # GuideLLM spawns one worker process per request up to 10; two carry this load
           # and leave the shared CPU to the server.
           "GUIDELLM__MAX_WORKER_PROCESSES": str(args.guidellm_workers)}
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    proc.args_text = " ".join(cmd)  # type: ignore[attr-defined]
    return proc


def finish_guidellm(proc: subprocess.Popen, out: Path) -> dict:
    rc = proc.wait()
    if rc != 0 or not out.exists():
        raise SystemExit(f"error: guidellm exited with {rc}; see {out.with_suffix('.log')}\n  {proc.args_text}")
    with open(out) as f:
        return {**guidellm_figures(json.load(f)), "command": proc.args_text}


def run_guidellm(exe: str, url: str, args, tokenizer_dir: str, seed: int, out: Path) -> dict:
    return finish_guidellm(start_guidellm(exe, url, args, tokenizer_dir, seed, out), out)


def wait_for_first_request(url: str, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    """Until the server runs or queues a request (GuideLLM's first, after its start-up)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        busy = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))
        if busy > 0:
            return
        time.sleep(0.1)
    raise SystemExit("error: GuideLLM sent no request (see its log)")


def run_together(exe: str, url: str, args, tokenizer_dir: str, vocab: int, seed: int, out: Path) -> list[dict]:
    """Both clients at once, each at ``--rate``, ours half an interval after GuideLLM's
    arrivals: the server sees one stream at twice the rate, and both clients measure the
    very same conditions (no drift between them)."""
    proc = start_guidellm(exe, url, args, tokenizer_dir, seed, out)
    wait_for_first_request(url, proc)
    time.sleep(0.5 / args.rate)
    ours = _timed(run_harness, url, args, vocab, seed)
    return [finish_guidellm(proc, out), ours]


def save_tokenizer(out_dir: str) -> int:
    """The embedded model's tokenizer as a plain HF directory GuideLLM can load offline."""
    from streamkv.models.loader import load_tokenizer, resolve_model_dir

    tok = load_tokenizer(resolve_model_dir(None))
    if tok is None:
        raise SystemExit("error: the embedded model has no tokenizer")
    tok.save_pretrained(out_dir)
    return len(tok)


def _timed(fn, *a) -> dict:
    """``fn``'s figures with its wall time and client CPU seconds (this process and the
    children it waited for: GuideLLM and its workers)."""
    r0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
    out = fn(*a)
    r1, c1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) + (c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime)
    return {**out, "wall_s": time.time() - t0, "client_cpu_s": cpu}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m load_tests.guidellm_crosscheck", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--guidellm", default=None, help=f"guidellm executable (default: $GUIDELLM or {DEFAULT_GUIDELLM})")
    p.add_argument("--mode", choices=["alternate", "together"], default="alternate",
                   help="alternate: GuideLLM's run, then ours, --pairs times; together: both at once, each at "
                        "--rate, arrivals interleaved (the server sees twice the rate)")
    p.add_argument("--pairs", type=int, default=3, help="GuideLLM-and-ours pairs of runs")
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--rate", type=float, default=0.5, help="req/s per client")
    p.add_argument("--arrivals", choices=["constant", "poisson"], default="constant",
                   help="constant intervals (can phase-lock two clients run together), or Poisson (GuideLLM "
                        "0.8.1's poisson profile misbehaved here: docs/paper.md)")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--max-duration", type=float, default=180.0, help="seconds per run at most")
    p.add_argument("--port", type=int, default=18731, help="the server's fixed loopback port")
    p.add_argument("--server-threads", type=int, default=1, help="OMP_NUM_THREADS of the server")
    p.add_argument("--server-args", nargs="*", default=["--num-kv-blocks", "256", "--max-model-len", "1024"],
                   help="extra `streamkv serve` flags")
    p.add_argument("--guidellm-workers", type=int, default=2, help="GUIDELLM__MAX_WORKER_PROCESSES")
    p.add_argument("--workdir", default=None, help="GuideLLM reports and logs (default: a temp dir)")
    p.add_argument("--json-out", default="bench_results/guidellm_crosscheck.json")
    args = p.parse_args(argv)
    exe = find_guidellm(args.guidellm)
    if exe is None:
        print("skipped: GuideLLM is not installed (pass --guidellm PATH or set $GUIDELLM; it lives in its own "
              "virtualenv, e.g. `python -m venv /tmp/guidellm-venv && /tmp/guidellm-venv/bin/pip install guidellm`)")
        return 0
    if not (1 <= args.num_requests <= 1000 and args.pairs >= 1 and args.rate > 0):
        raise SystemExit("error: --num-requests in [1, 1000], --pairs >= 1, --rate > 0")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="guidellm-crosscheck-"))
    workdir.mkdir(parents=True, exist_ok=True)
    args.server_log = str(workdir / "serve.log")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip()
    tok_dir = str(workdir / "tokenizer")
    vocab = save_tokenizer(tok_dir)
    runs: list[dict] = []
    with serve(args) as (url, pid):
        run_harness(url, argparse.Namespace(**{**vars(args), "num_requests": 4, "rate": 4.0}), vocab, 999)  # warm-up
        for i in range(args.pairs):
            gl_out = workdir / f"guidellm-{i}.json"
            if args.mode == "together":
                cpu0, c0 = _cpu_seconds(pid), resource.getrusage(resource.RUSAGE_CHILDREN)
                gl, ours = run_together(exe, url, args, tok_dir, vocab, i, gl_out)
                c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                gl.update(client_cpu_s=c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime, wall_s=float("nan"))
                both = _cpu_seconds(pid) - cpu0  # one server run serves both clients
                pair = [("guidellm", gl, both), ("harness", ours, both)]
            else:
                pair = []
                for client in ("guidellm", "harness"):
                    cpu0 = _cpu_seconds(pid)
                    fig = (_timed(run_guidellm, exe, url, args, tok_dir, i, gl_out) if client == "guidellm"
                           else _timed(run_harness, url, args, vocab, i))
                    pair.append((client, fig, _cpu_seconds(pid) - cpu0))
            for client, fig, server_cpu in pair:
                runs.append({"pair": i, "client": client, **fig, "server_cpu_s": server_cpu})
                print(f"pair {i} {client}: TTFT p50 {fig['ttft_ms']:.0f} ms, ITL p50 {fig['itl_ms']:.0f} ms "
                      f"({fig['completed']} done)", flush=True)
    summary = compare(runs)
    print(format_table(runs, summary))
    os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump({"guidellm_version": version, "args": {k: v for k, v in vars(args).items()},
                   "runs": runs, "summary": summary}, f, indent=1, default=str)
    print(f"wrote {args.json_out}; GuideLLM reports in {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
