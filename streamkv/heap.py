"""The cyclic garbage collector in a serving process (the server's, a worker rank's).

Start-up leaves a heap of objects that live as long as the process (torch, the model, its
CUDA graphs, the app); ``gc.freeze`` takes them out of every later collection. Serving then
keeps ~300 tracked objects alive per open request (its sequence, stream, task, connection),
~300,000 under a burst of 1,000, and Python's default thresholds (700, 10, 10) ran a full
collection over them every ~100 young ones: on the H200 burst, 25 full collections of ~90 ms
each in the server process, each holding the GIL while the device waited for the next step
(benchmarks/gc_probe, docs/benchmarks.md "Serving"). A young generation of
``YOUNG_THRESHOLD`` makes all three generations run that much less often; the per-step
objects that die young are freed by reference counting either way.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000


def freeze_heap() -> None:
    """Collect, freeze what is left (alive for the process's life), and collect the young
    generation ``YOUNG_THRESHOLD`` tracked allocations at a time from now on."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)


def refreeze_heap() -> None:
    """After an engine restart: freeze again if this process froze its heap before (its
    young threshold says so). Releasing the old in-process worker unfroze everything, so
    that its cycles could be freed (``Worker.release``)."""
    if gc.get_threshold()[0] == YOUNG_THRESHOLD:
        freeze_heap()
