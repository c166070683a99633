"""No garbage collection while CUDA graphs are captured.

A collected object's destructor may call a CUDA function that stream capture forbids (a
pinned host buffer, an event, a loaded module of an engine dropped earlier in the process):
the capture fails with an error raised inside a destructor, which aborts the process. So
garbage is collected before the capture and the collector is paused during it (vLLM's graph
capture does the same).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
