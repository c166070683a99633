"""A serving process freezes its start-up heap (heap.py) and a worker's release thaws it,
so that reference cycles among what the worker dropped are still collected."""

from __future__ import annotations

import gc
import types
import weakref

import torch

from streamkv.heap import YOUNG_THRESHOLD, freeze_heap
from streamkv.worker.worker import Worker


class _Node:
    pass


def test_release_collects_cycles_frozen_at_start_up() -> None:
    model = _Node()
    model.me = model  # a cycle: only the cyclic collector frees it
    dead = weakref.ref(model)
    worker = types.SimpleNamespace(model=model, device=torch.device("cpu"))
    del model
    thresholds = gc.get_threshold()
    try:
        freeze_heap()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold()[0] == YOUNG_THRESHOLD
        gc.collect()
        assert dead() is not None  # frozen: out of the collector's reach
        Worker.release(worker)
        assert worker.model is None
        assert dead() is None
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
