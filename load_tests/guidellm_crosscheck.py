"""Cross-check of our load harness against a client nobody here wrote: GuideLLM.

Both clients drive the same ``streamkv serve`` (started here on 127.0.0.1 and a fixed port)
with the same workload shape: N requests at a constant rate, each with a P-token prompt and
exactly M output tokens (``ignore_eos``), streamed over ``/v1/completions``. ``--mode
alternate`` (the figure) runs them in separate intervals, one after the other, in ABBA order
(GuideLLM, ours, ours, GuideLLM, ...: drift that is linear in time cancels), each after the
server has been idle ``--idle-gap`` seconds; ``--mode together`` runs both at once, ours half
an interval after GuideLLM's arrivals (constant intervals can phase-lock the two: docs/paper.md).
``--pin`` puts the server on CPU 0 and both clients on CPU 1, so neither client's own CPU
work slows the server it measures. Per run
it records each client's own TTFT and ITL medians, and both clients' raw timings recomputed
under one definition, so a disagreement splits into "the clients define it differently"
and "the clients measure differently":

- TTFT. GuideLLM: first streamed token - request start (headers written). Ours: first
  streamed token - *scheduled* arrival (``load_tests/runner.py``: coordinated omission).
- ITL. GuideLLM: per request (last token - first token) / (tokens - 1), then the median over
  requests (token-weighted; all weights equal here). Ours: every gap between successive
  deliveries, pooled over requests, then the median.

Each run also keeps its per-request values under one definition (TTFT from send, ITL per
request), and the summary pools them per client over all runs, with a bootstrap interval for
the ratio and each client's run-to-run spread (load_tests/crosscheck_stats.py).

    python -m load_tests.guidellm_crosscheck --mode alternate --pairs 4 --num-requests 32 \\
        --rate 0.4 --prompt-tokens 32 --output-tokens 16 --pin \\
        --json-out bench_results/guidellm_crosscheck.json

GuideLLM lives in its own virtualenv (``--guidellm``, default $GUIDELLM or
/tmp/guidellm-venv/bin/guidellm); without it this prints why and exits 0 (CI does not
install it). It gets a local tokenizer directory (the embedded model's, saved here) and
HF_HUB_OFFLINE=1: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from load_tests.crosscheck_stats import (
    compare,
    format_pooled,
    format_table,
    guidellm_figures,
    harness_figures,
    pooled,
)
from load_tests.local_server import local_server

DEFAULT_GUIDELLM = "/tmp/guidellm-venv/bin/guidellm"


def find_guidellm(path: str | None) -> str | None:
    """The guidellm executable, or None where it is not installed."""
    for candidate in (path, os.environ.get("GUIDELLM"), DEFAULT_GUIDELLM, shutil.which("guidellm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve(args):
    """``streamkv serve`` on 127.0.0.1:``--port`` (the embedded model), until the block ends;
    with ``--pin``, on CPU 0 only."""
    env = {"OMP_NUM_THREADS": str(args.server_threads)}
    return local_server(
        ["--device", "cpu", *args.server_args],
        port=args.port,
        log_path=args.server_log,
        env=env,
        cpus={0} if args.pin else None,
    )


def synthetic_requests(
    num: int, prompt_tokens: int, output_tokens: int, vocab: int, seed: int
) -> list:
    """Distinct random prompts (no prefix-cache hit, as GuideLLM's distinct synthetic text)."""
    from load_tests.workloads import BenchRequest

    rng = random.Random(seed)
    return [
        BenchRequest([rng.randrange(1000, vocab) for _ in range(prompt_tokens)], output_tokens)
        for _ in range(num)
    ]


def run_harness(url: str, args, vocab: int, seed: int) -> dict:
    from load_tests.arrivals import arrival_times
    from load_tests.drivers import OpenAIDriver
    from load_tests.runner import run_open_loop

    requests = synthetic_requests(
        args.num_requests, args.prompt_tokens, args.output_tokens, vocab, seed
    )
    # Gamma gaps of shape 1e6 are constant intervals in effect (GuideLLM's constant profile);
    # shape 1 is the Poisson process (its poisson profile).
    arrivals = arrival_times(
        len(requests), args.rate, burstiness=1e6 if args.arrivals == "constant" else 1.0, seed=seed
    )

    async def go():
        driver = OpenAIDriver(url)
        try:
            return await run_open_loop(driver, requests, arrivals, args.max_duration)
        finally:
            await driver.close()

    records, duration = asyncio.run(go())
    return harness_figures(records, duration)


def start_guidellm(
    exe: str, url: str, args, tokenizer_dir: str, seed: int, out: Path
) -> subprocess.Popen:
    cmd = [
        exe,
        "run",
        "--backend",
        f"kind=openai_http,target={url},request_format=/v1/completions",
        "--profile",
        f"kind={args.arrivals},rate={args.rate}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
        "--data-loader",
        f"kind=pytorch,samples={args.num_requests},prefetch_factor={args.num_requests}",
        "--tokenizer",
        f"kind=hf_auto,model={tokenizer_dir}",
        "--seed",
        f"kind=static,value={seed}",
        "--constraint",
        f"kind=max_requests,count={args.num_requests}",
        "--constraint",
        f"kind=max_duration,seconds={args.max_duration}",
        "--output",
        f"kind=json,path={out}",
        "--disable-console-interactive",
    ]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # GuideLLM spawns one worker process per request up to 10; two carry this load
        # and leave the shared CPU to the server.
        "GUIDELLM__MAX_WORKER_PROCESSES": str(args.guidellm_workers),
    }
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    proc.args_text = " ".join(cmd)  # type: ignore[attr-defined]
    return proc


def finish_guidellm(proc: subprocess.Popen, out: Path) -> dict:
    rc = proc.wait()
    if rc != 0 or not out.exists():
        raise SystemExit(
            f"error: guidellm exited with {rc}; see {out.with_suffix('.log')}\n  {proc.args_text}"
        )
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
        busy = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))
        )
        if busy > 0:
            return
        time.sleep(0.1)
    raise SystemExit("error: GuideLLM sent no request (see its log)")


def run_together(
    exe: str, url: str, args, tokenizer_dir: str, vocab: int, seed: int, out: Path
) -> list[dict]:
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
    r0, c0, t0 = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
        time.time(),
    )
    out = fn(*a)
    r1, c1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) + (
        c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime
    )
    return {**out, "wall_s": time.time() - t0, "client_cpu_s": cpu}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m load_tests.guidellm_crosscheck",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--guidellm",
        default=None,
        help=f"guidellm executable (default: $GUIDELLM or {DEFAULT_GUIDELLM})",
    )
    p.add_argument(
        "--mode",
        choices=["alternate", "together"],
        default="alternate",
        help="alternate: GuideLLM's run, then ours, --pairs times; together: both at once, each at "
        "--rate, arrivals interleaved (the server sees twice the rate)",
    )
    p.add_argument("--pairs", type=int, default=4, help="GuideLLM-and-ours pairs of runs")
    p.add_argument(
        "--order",
        choices=["abba", "abab"],
        default="abba",
        help="alternate: abba swaps who goes first every other pair (linear drift cancels)",
    )
    p.add_argument(
        "--idle-gap", type=float, default=5.0, help="alternate: idle seconds before each run"
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="server on CPU 0, this process and GuideLLM on CPU 1 (needs 2 CPUs)",
    )
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--rate", type=float, default=0.5, help="req/s per client")
    p.add_argument(
        "--arrivals",
        choices=["constant", "poisson"],
        default="constant",
        help="constant intervals (can phase-lock two clients run together), or Poisson (GuideLLM "
        "0.8.1's poisson profile misbehaved here: docs/paper.md)",
    )
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--max-duration", type=float, default=180.0, help="seconds per run at most")
    p.add_argument("--port", type=int, default=18731, help="the server's fixed loopback port")
    p.add_argument("--server-threads", type=int, default=1, help="OMP_NUM_THREADS of the server")
    p.add_argument(
        "--server-args",
        nargs="*",
        default=["--num-kv-blocks", "256", "--max-model-len", "1024"],
        help="extra `streamkv serve` flags",
    )
    p.add_argument("--guidellm-workers", type=int, default=2, help="GUIDELLM__MAX_WORKER_PROCESSES")
    p.add_argument(
        "--workdir", default=None, help="GuideLLM reports and logs (default: a temp dir)"
    )
    p.add_argument("--json-out", default="bench_results/guidellm_crosscheck.json")
    args = p.parse_args(argv)
    exe = find_guidellm(args.guidellm)
    if exe is None:
        print(
            "skipped: GuideLLM is not installed (pass --guidellm "
            "PATH or set $GUIDELLM; it lives in its own "
            "virtualenv, e.g. `python -m venv /tmp/guidellm-venv "
            "&& /tmp/guidellm-venv/bin/pip install guidellm`)"
        )
        return 0
    if not (
        1 <= args.num_requests <= 1000 and args.pairs >= 1 and args.rate > 0 and args.idle_gap >= 0
    ):
        raise SystemExit(
            "error: --num-requests in [1, 1000], --pairs >= 1, --rate > 0, --idle-gap >= 0"
        )
    if args.pin and len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("error: --pin needs two CPUs (server on 0, clients on 1)")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="guidellm-crosscheck-"))
    workdir.mkdir(parents=True, exist_ok=True)
    args.server_log = str(workdir / "serve.log")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip()
    tok_dir = str(workdir / "tokenizer")
    vocab = save_tokenizer(tok_dir)
    runs: list[dict] = []
    with serve(args) as server:
        url, pid = server.url, server.proc.pid
        if args.pin:
            os.sched_setaffinity(0, {1})  # this process and GuideLLM's, its children
        run_harness(
            url, argparse.Namespace(**{**vars(args), "num_requests": 4, "rate": 4.0}), vocab, 999
        )  # warm-up
        for i in range(args.pairs):
            gl_out = workdir / f"guidellm-{i}.json"
            if args.mode == "together":
                cpu0, c0 = _cpu_seconds(pid), resource.getrusage(resource.RUSAGE_CHILDREN)
                gl, ours = run_together(exe, url, args, tok_dir, vocab, i, gl_out)
                c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                gl.update(
                    client_cpu_s=c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime,
                    wall_s=float("nan"),
                )
                both = _cpu_seconds(pid) - cpu0  # one server run serves both clients
                pair = [("guidellm", gl, both), ("harness", ours, both)]
            else:
                pair = []
                order = (
                    ("guidellm", "harness")
                    if args.order == "abab" or i % 2 == 0
                    else ("harness", "guidellm")
                )
                for client in order:
                    time.sleep(args.idle_gap)
                    cpu0 = _cpu_seconds(pid)
                    fig = (
                        _timed(run_guidellm, exe, url, args, tok_dir, i, gl_out)
                        if client == "guidellm"
                        else _timed(run_harness, url, args, vocab, i)
                    )
                    fig["load_average_1m_after"] = os.getloadavg()[0]
                    pair.append((client, fig, _cpu_seconds(pid) - cpu0))
            for client, fig, server_cpu in pair:
                runs.append({"pair": i, "client": client, **fig, "server_cpu_s": server_cpu})
                print(
                    f"pair {i} {client}: TTFT p50 {fig['ttft_ms']:.0f} "
                    f"ms, ITL p50 {fig['itl_ms']:.0f} ms "
                    f"({fig['completed']} done)",
                    flush=True,
                )
    summary, pooled_summary = compare(runs), pooled(runs)
    print(format_table(runs, summary))
    print()
    print(format_pooled(pooled_summary))
    os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump(
            {
                "guidellm_version": version,
                "args": {k: v for k, v in vars(args).items()},
                "load_average": os.getloadavg(),
                "runs": runs,
                "summary": summary,
                "pooled": pooled_summary,
            },
            f,
            indent=1,
            default=str,
        )
    print(f"wrote {args.json_out}; GuideLLM reports in {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
