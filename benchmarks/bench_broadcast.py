"""What broadcasting one step to every tensor-parallel rank costs: the bytes of the encoded
StepInput and the engine's time to encode it, write it to every rank and gather every
rank's answer (rank 0's StepOutput, the others' Ok: executor/multiproc.py's protocol).

The ranks are fake (no torch, no model): processes that decode each step as a real rank
does (executor/ipc.py) and answer at once, so the times are the message path alone. Over
socket pairs (ranks on the engine's host) or TCP loopback (ranks joined from other hosts).

Steps are built like the engine's StepBuilder builds them (messages.py): ``decode``, every
sequence computes one token at its context length and ~1/16 of them start a new block;
``mixed``, a token budget of prompt tokens for new sequences (each sent once, as NewSeq)
plus decodes for the rest of the batch.

    python benchmarks/bench_broadcast.py --batch 256 --tp 8 --json-out /tmp/broadcast.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamkv.executor import ipc  # noqa: E402
from streamkv.messages import NewSeq, SampleResult, SeqParams, SeqStep, StepInput, StepOutput  # noqa: E402

BLOCK = 16


def decode_step(batch: int, rng: random.Random) -> StepInput:
    seqs = []
    for i in range(batch):
        pos = rng.randint(64, 1500)  # ShareGPT-like contexts
        grows = pos % BLOCK == 0
        seqs.append(
            SeqStep(i, [rng.randrange(32000)], pos, True, [rng.randrange(20000)] if grows else [])
        )
    return StepInput(seqs=seqs, finished_ids=[batch + 7] if rng.random() < 0.05 else [])


def mixed_step(batch: int, budget: int, prompt_len: int, rng: random.Random) -> StepInput:
    step = decode_step(batch, rng)
    new, left, seq_id = [], budget, 10_000
    while left > 0 and len(new) < batch:
        n = min(prompt_len, left)
        ids = [rng.randrange(32000) for _ in range(n)]
        blocks = [rng.randrange(20000) for _ in range(-(-n // BLOCK))]
        new.append(NewSeq(seq_id, SeqParams(temperature=0.8, top_p=0.95), n))
        step.seqs.append(SeqStep(seq_id, ids, 0, True, blocks))
        seq_id, left = seq_id + 1, left - n
    del step.seqs[: len(new)]  # the batch stays ``batch`` sequences
    step.new_seqs = new
    return step


def output_for(step: StepInput) -> bytes:
    out = StepOutput(
        {s.seq_id: SampleResult([s.seq_id % 32000], [-0.5]) for s in step.seqs if s.sample}
    )
    return ipc.encode(ipc.Out(out, 0.0))


# -- a fake rank ---------------------------------------------------------------------------
def fake_rank(fd: int, rank: int) -> None:
    conn = Connection(fd)
    decoder = ipc.worker_decoder()
    ok = ipc.encode(ipc.Ok())
    while True:
        try:
            msg = decoder.decode(conn.recv_bytes())
        except EOFError:
            return
        if isinstance(msg, ipc.Shutdown):
            return
        # Rank 0 answers with an output of the step's size (sent ready-made: not measured here).
        conn.send_bytes(output_for(msg.step) if rank == 0 else ok)


def start_ranks(tp: int, transport: str) -> tuple[list[Connection], list[subprocess.Popen]]:
    conns, procs = [], []
    listener = None
    if transport == "tcp":
        listener = socket.create_server(("127.0.0.1", 0))
    for rank in range(tp):
        if transport == "tcp":
            theirs = socket.create_connection(listener.getsockname())
            ours, _ = listener.accept()
            for s in (ours, theirs):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:
            ours, theirs = socket.socketpair()
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--fake-rank", str(theirs.fileno()), str(rank)],
                pass_fds=(theirs.fileno(),),
            )
        )
        theirs.close()
        conns.append(Connection(ours.detach()))
    if listener is not None:
        listener.close()
    return conns, procs


def measure(conns: list[Connection], steps: list[StepInput]) -> dict:
    decoder = ipc.engine_decoder()
    enc, send, total, sizes, rank_decode = [], [], [], [], []
    worker_decoder = ipc.worker_decoder()
    for step in steps:
        t0 = time.perf_counter()
        payload = ipc.encode(ipc.Step(step))
        t1 = time.perf_counter()
        for conn in conns:
            conn.send_bytes(payload)
        t2 = time.perf_counter()
        pending = set(range(len(conns)))
        while pending:
            for conn in wait([conns[r] for r in pending]):
                r = conns.index(conn)
                decoder.decode(conn.recv_bytes())
                pending.discard(r)
        t3 = time.perf_counter()
        d0 = time.perf_counter()
        worker_decoder.decode(payload)
        rank_decode.append(time.perf_counter() - d0)
        enc.append(t1 - t0)
        send.append(t2 - t1)
        total.append(t3 - t0)
        sizes.append(len(payload))

    def us(xs: list[float]) -> float:
        return round(1e6 * statistics.median(xs), 1)

    return {
        "bytes": int(statistics.median(sizes)),
        "bytes_per_seq": round(statistics.median(sizes) / len(steps[0].seqs), 1),
        "encode_us": us(enc),
        "send_all_us": us(send),
        "rank_decode_us": us(rank_decode),
        "roundtrip_us": us(total),
        "roundtrip_p90_us": round(1e6 * sorted(total)[int(0.9 * len(total))], 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch", type=int, default=256, help="sequences per step")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 8], help="ranks (fake processes)")
    ap.add_argument("--steps", type=int, default=300, help="steps measured per case")
    ap.add_argument("--budget", type=int, default=2048, help="prompt tokens of a mixed step")
    ap.add_argument(
        "--prompt-len", type=int, default=256, help="tokens per new prompt of a mixed step"
    )
    ap.add_argument(
        "--transport", nargs="+", choices=["socketpair", "tcp"], default=["socketpair", "tcp"]
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default="bench_results/broadcast.json")
    ap.add_argument(
        "--fake-rank", nargs=2, type=int, metavar=("FD", "RANK"), help=argparse.SUPPRESS
    )
    args = ap.parse_args()
    if args.fake_rank:
        fake_rank(*args.fake_rank)
        return 0
    rng = random.Random(args.seed)
    cases = {
        "decode": [decode_step(args.batch, rng) for _ in range(args.steps)],
        "mixed": [
            mixed_step(args.batch, args.budget, args.prompt_len, rng) for _ in range(args.steps)
        ],
    }
    rows = []
    for transport in args.transport:
        for tp in args.tp:
            conns, procs = start_ranks(tp, transport)
            try:
                for name, steps in cases.items():
                    measure(conns, steps[:20])  # warm-up
                    rows.append(
                        {
                            "transport": transport,
                            "tp": tp,
                            "step": name,
                            "batch": args.batch,
                            **measure(conns, steps),
                        }
                    )
            finally:
                for conn in conns:
                    conn.close()
                for proc in procs:
                    proc.wait(10)
    header = [
        "transport",
        "tp",
        "step",
        "bytes",
        "bytes_per_seq",
        "encode_us",
        "send_all_us",
        "rank_decode_us",
        "roundtrip_us",
        "roundtrip_p90_us",
    ]
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(str(row[h]) for h in header))
    os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump({"args": vars(args), "cpus": os.cpu_count(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
