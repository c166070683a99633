"""The server ``streamkv bench serve`` measures: started on a free port (from another checkout
with --server-tree) and waited for, then watched from outside: its RSS, its threads' CPU
time, a py-spy profile, and its KV-cache usage after a run (from /metrics).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
import urllib.request


def start_server(args, log) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "streamkv.entrypoints.cli",
        "serve",
        *([args.model] if args.model else []),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-access-log",
        *shlex.split(args.engine_args),
        *shlex.split(args.server_args),
    ]
    env, cwd = None, None
    if args.server_tree:  # another checkout's server (a before/after pair in one call)
        # Run from that tree with it first on the path, for the worker processes it spawns
        # too (a spawned child puts its working directory first): paths in --engine-args
        # must then be absolute.
        cwd = os.path.abspath(args.server_tree)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([cwd, os.environ.get("PYTHONPATH", "")])}
    print("server:", shlex.join(cmd), f"(in {cwd})" if cwd else "", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log.name}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(
        f"the server did not become healthy in {args.startup_timeout} s; see {log.name}"
    )


def model_name(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def kv_blocks_in_use(url: str) -> float:
    """``vllm:kv_cache_usage_perc`` from /metrics: 0 once every request has ended and freed
    its blocks (cached prefix blocks with no reader count as free)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:kv_cache_usage_perc"):
                return float(line.rsplit(" ", 1)[1])
    return math.nan


def rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return math.nan


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of ``pid`` (Linux /proc)."""
    out = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        pass
    return out


def profile_later(args, pid: int) -> threading.Thread | None:
    """--py-spy PREFIX: sample the server and its workers (--subprocesses) for --py-spy-seconds,
    starting --py-spy-delay seconds into the first rate's run."""
    if not args.py_spy:
        return None

    def record() -> None:
        time.sleep(args.py_spy_delay)
        # --gil: only the thread holding the GIL is sampled, so the profile is what the event
        # loop and the engine thread take of the one interpreter they share.
        # --nonblocking: a blocking py-spy stops the server for every sample (the H200 burst
        # fell from 11.6k to 9.2k tok/s under it).
        cmd = [
            "py-spy",
            "record",
            "--pid",
            str(pid),
            "--subprocesses",
            "--threads",
            "--gil",
            "--nonblocking",
            "--rate",
            "200",
            "--duration",
            str(int(args.py_spy_seconds)),
            "--format",
            "raw",
            "-o",
            f"{args.py_spy}.txt",
        ]
        with open(f"{args.py_spy}.err", "w") as err:
            subprocess.run(
                cmd, stdout=err, stderr=subprocess.STDOUT, timeout=args.py_spy_seconds + 120
            )

    t = threading.Thread(target=record, daemon=True)
    t.start()
    return t
