"""A diagnosis, not a product figure: every Python process started with this directory on
PYTHONPATH and $GCPROBE_DIR set records its cyclic-GC collections (count and seconds per
generation, the longest pause, pauses over 10 ms) and rewrites one line about them to
$GCPROBE_DIR/<pid> every two seconds, from a daemon thread.

    GCPROBE_DIR=/tmp/gc PYTHONPATH=benchmarks/gc_probe python3 benchmarks/bench_serve.py ...
    tail -qn1 /tmp/gc/*
"""

import gc
import os
import sys
import threading
import time

_DIR = os.environ.get("GCPROBE_DIR")
if _DIR:
    os.makedirs(_DIR, exist_ok=True)
    _start = [0.0]
    _count, _seconds, _long = [0, 0, 0], [0.0, 0.0, 0.0], [0, 0.0, 0.0]  # n > 10 ms, s, max

    def _timed(phase: str, info: dict) -> None:
        if phase == "start":
            _start[0] = time.perf_counter()
            return
        took, gen = time.perf_counter() - _start[0], info["generation"]
        _count[gen] += 1
        _seconds[gen] += took
        _long[2] = max(_long[2], took)
        if took > 0.01:
            _long[0] += 1
            _long[1] += took

    def _write() -> None:
        name = " ".join(os.path.basename(a) for a in sys.argv[:4])[:80]
        while True:
            time.sleep(2)
            line = (
                f"pid {os.getpid()} [{name}] collections {_count} seconds "
                f"{[round(s, 3) for s in _seconds]} pauses>10ms {_long[0]} ({_long[1]:.3f} s) "
                f"max {_long[2] * 1e3:.1f} ms frozen {gc.get_freeze_count()}\n"
            )
            with open(os.path.join(_DIR, str(os.getpid())), "w") as f:
                f.write(line)

    gc.callbacks.append(_timed)
    threading.Thread(target=_write, daemon=True, name="gc-probe").start()
