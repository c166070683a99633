"""Recovery time after a worker fault: a real ``streamkv serve`` with the model in a worker
process (mp); one greedy stream runs, the worker gets SIGKILL (dies) or SIGSTOP (freezes)
after a few tokens, and the times from the fault are measured: ``detected`` (/health first
answers 503), ``restarted`` (/health 200 again), ``first_token`` (the next chunk of the
resumed stream). The resumed stream's text is checked against a fault-free run.

    python benchmarks/bench_recovery.py --json-out /tmp/recovery.json

On one GPU with a shape preset's dummy weights (a preset has no tokenizer: the server gets a
copy of its config.json with a synthetic one, "t0".."tN" one word per id, so that the
resumed text can still be compared):

    python benchmarks/bench_recovery.py --model llama3-8b --device cuda --dtype bfloat16 \
        --num-kv-blocks 4096 --max-num-seqs 8 --faults SIGKILL,SIGSTOP \
        --json-out /tmp/recovery_gpu.json
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
SYNTHETIC_PROMPT = " ".join(f"t{i}" for i in range(100, 132))


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


def synthetic_model_dir(preset: str) -> str:
    """A directory with ``preset``'s config.json (weights: dummy) and a word-level tokenizer
    of its vocabulary size, so that text can be compared."""
    import tempfile

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from streamkv.models.loader import load_config, resolve_model_dir

    config = load_config(resolve_model_dir(preset))
    out = tempfile.mkdtemp(prefix=f"streamkv-{preset}-synthetic-")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    words = Tokenizer(
        models.WordLevel({f"t{i}": i for i in range(config["vocab_size"])}, unk_token="t0")
    )
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0").save_pretrained(out)
    return out


def one_fault(url: str, server_pid: int, fault: signal.Signals, expected: str, body: dict) -> dict:
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
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=600
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunks.append(json.loads(line[6:]))
            if t_fault is not None and "first_token" not in marks:
                marks["first_token"] = time.monotonic()
            if len(chunks) == 5:
                pid = worker_pids(server_pid)[-1]  # at TP > 1: the last rank
                os.kill(pid, fault)
                t_fault = time.monotonic()
                poller.start()
    stop.set()
    poller.join()
    text = "".join(c["choices"][0]["text"] for c in chunks)
    return {
        "fault": fault.name,
        "same_text": text == expected,
        **{k: round(v - t_fault, 2) for k, v in sorted(marks.items(), key=lambda kv: kv[1])},
    }


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--faults", default="SIGKILL,SIGSTOP,SIGKILL,SIGSTOP")
    p.add_argument("--json-out", default=None)
    p.add_argument(
        "--model",
        default=None,
        help="a model the server takes; a shape preset (e.g. llama3-8b) "
        "gets dummy weights and a synthetic tokenizer (see above)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-kv-blocks", type=int, default=256)
    p.add_argument(
        "--max-num-seqs", type=int, default=None, help="fewer decode graphs to capture on a GPU"
    )
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs (a faster restart on a GPU)"
    )
    args = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    body = BODY
    model_args: list[str] = []
    if args.model is not None:
        from streamkv.models.loader import presets

        if args.model in presets():
            model_args = [synthetic_model_dir(args.model), "--load-format", "dummy"]
            body = {**BODY, "prompt": SYNTHETIC_PROMPT}
        else:
            model_args = [args.model]
    cmd = [
        sys.executable,
        "-m",
        "streamkv.entrypoints.cli",
        "--log-level",
        "WARNING",
        "serve",
        *model_args,
        "--port",
        str(port),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--num-kv-blocks",
        str(args.num_kv_blocks),
        "--num-swap-blocks",
        "64",
        "--max-model-len",
        "1024",
        "--tensor-parallel-size",
        str(args.tensor_parallel_size),
        "--distributed-executor-backend",
        "mp",
        "--no-access-log",
        "--max-worker-restarts",
        "10",
    ]
    if args.max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(args.max_num_seqs)]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    start = time.monotonic()
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
        started_s = time.monotonic() - start
        expected = httpx.post(f"{url}/v1/completions", json=body, timeout=600).json()["choices"][0][
            "text"
        ]
        rows = [
            one_fault(url, proc.pid, signal.Signals[name], expected, body)
            for name in args.faults.split(",")
        ]
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"{'fault':8} {'detected s':>11} {'restarted s':>12} {'first token s':>14} same text")
    for r in rows:
        print(
            f"{r['fault']:8} {r.get('detected', float('nan')):11.2f} "
            f"{r.get('restarted', float('nan')):12.2f} "
            f"{r.get('first_token', float('nan')):14.2f} {r['same_text']}"
        )
    print(f"server start (model load, cache, graphs): {started_s:.1f} s")
    result = {
        "args": vars(args),
        "server_start_s": round(started_s, 2),
        "load_average": os.getloadavg(),
        "rows": rows,
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if all(r["same_text"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
