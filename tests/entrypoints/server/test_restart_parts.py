"""A request of several samples resumed after a worker restart runs as one request per
sample (engine/recovery.py); the book treats them as one: a part the new engine refuses
ends the request, and the other parts with it."""

from __future__ import annotations

import asyncio
import gc

import pytest

from streamkv.engine.async_engine import AsyncEngine
from streamkv.engine.request_book import EngineDeadError
from streamkv.heap import YOUNG_THRESHOLD, freeze_heap
from streamkv.sampling_params import SamplingParams
from tests.entrypoints.server.test_async_engine import DyingEngine, run


class RefusingEngine(DyingEngine):
    """Never dies; refuses to take the request ids in ``refuse``."""

    def __init__(self, refuse: set[str], **kw) -> None:
        super().__init__(die_at=None, **kw)
        self.refuse = refuse

    def add_request(self, request_id, *args, **kw):
        if request_id in self.refuse:
            raise ValueError(f"no room for {request_id}")
        super().add_request(request_id, *args, **kw)


def test_a_refused_sample_ends_its_request_and_aborts_the_other_samples():
    async def main():
        second = RefusingEngine({"w#sample-1"}, step_delay=0.002)
        builds = [DyingEngine(die_at=8, step_delay=0.002), second]
        engine = AsyncEngine(lambda: builds.pop(0))
        engine.start()
        await engine.wait_ready()
        stream = await engine.add_request("w", [9], SamplingParams(max_tokens=10_000, n=3))
        with pytest.raises(EngineDeadError, match="no room for w#sample-1"):
            async for _ in stream:
                pass
        for _ in range(100):
            if len(second.aborted) >= 2:
                break
            await asyncio.sleep(0.01)
        assert second.added == ["w#sample-0", "w#sample-2"]
        assert sorted(second.aborted) == ["w#sample-0", "w#sample-2"] and not second.requests
        assert engine.num_open_streams == 0
        await engine.stop()

    run(main())


class ThawingEngine(DyingEngine):
    """Its shutdown unfreezes the heap, as releasing an in-process worker does."""

    def shutdown(self) -> None:
        gc.unfreeze()
        super().shutdown()


def test_a_restart_freezes_the_heap_again():
    async def main():
        freeze_heap()  # as the server's lifespan does once the engine is ready
        builds = [ThawingEngine(die_at=4, step_delay=0.002), DyingEngine(die_at=None)]
        engine = AsyncEngine(lambda: builds.pop(0))
        engine.start()
        await engine.wait_ready()
        stream = await engine.add_request("f", [9], SamplingParams(max_tokens=20))
        outs = [o async for o in stream]
        assert outs[-1].finished and not builds  # the second engine finished it
        assert gc.get_freeze_count() > 0 and gc.get_threshold()[0] == YOUNG_THRESHOLD
        await engine.stop()

    run(main())
