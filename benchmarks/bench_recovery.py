"""Recovery time after a worker fault: a real ``streamkv serve`` with the model in a worker
process (mp); one greedy stream runs, the worker gets SIGKILL (dies) or SIGSTOP (freezes)
after a few tokens, and the times from the fault are measured: ``detected`` (/health first
answers 503), ``restarted`` (/health 200 again), ``first_token`` (the next chunk of the
resumed stream). The resumed stream's text is checked against a fault-free run.

    python benchmarks/bench_recovery.py --json-out /tmp/recovery.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

BODY = {"prompt": "The history of the sea:", "max_tokens": 40, "ignore_eos": True, "temperature": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_pids(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as c:
                    if b"streamkv.executor.rank" in c.read():
                        out.append(int(child))
    return out


def one_fault(url: str, server_pid: int, fault: signal.Signals, expected: str) -> dict:
    marks: dict[str, float] = {}
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            try:
                code = httpx.get(f"{url}/health", timeout=5).status_code
            except httpx.TransportError:
                code = 0
            now = time.monotonic()
            if code == 503:
                marks.setdefault("detected", now)
            elif code == 200 and "detected" in marks:
                marks.setdefault("restarted", now)
            time.sleep(0.05)

    poller = threading.Thread(target=poll, daemon=True)
    chunks, t_fault = [], None
    with httpx.stream("POST", f"{url}/v1/completions", json={**BODY, "stream": True}, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunks.append(json.loads(line[6:]))
            if t_fault is not None and "first_token" not in marks:
                marks["first_token"] = time.monotonic()
            if len(chunks) == 5:
                (pid,) = worker_pids(server_pid)
                os.kill(pid, fault)
                t_fault = time.monotonic()
                poller.start()
    stop.set()
    poller.join()
    text = "".join(c["choices"][0]["text"] for c in chunks)
    return {"fault": fault.name, "same_text": text == expected,
            **{k: round(v - t_fault, 2) for k, v in sorted(marks.items(), key=lambda kv: kv[1])}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", default="SIGKILL,SIGSTOP,SIGKILL,SIGSTOP")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "streamkv.entrypoints.cli", "--log-level", "WARNING", "serve", "--port", str(port),
           "--device", "cpu", "--num-kv-blocks", "256", "--num-swap-blocks", "64", "--max-model-len", "1024",
           "--distributed-executor-backend", "mp", "--no-access-log", "--max-worker-restarts", "10"]
    proc = subprocess.Popen(cmd)
    try:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None:
                raise SystemExit("the server exited")
            time.sleep(0.5)
        expected = httpx.post(f"{url}/v1/completions", json=BODY, timeout=600).json()["choices"][0]["text"]
        rows = [one_fault(url, proc.pid, signal.Signals[name], expected) for name in args.faults.split(",")]
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"{'fault':8} {'detected s':>11} {'restarted s':>12} {'first token s':>14} same text")
    for r in rows:
        print(f"{r['fault']:8} {r.get('detected', float('nan')):11.2f} {r.get('restarted', float('nan')):12.2f} "
              f"{r.get('first_token', float('nan')):14.2f} {r['same_text']}")
    result = {"load_average": os.getloadavg(), "rows": rows}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if all(r["same_text"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
