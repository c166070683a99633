"""A grammar compiles off the engine thread (issue 26): while a slow compile runs, another
stream keeps getting tokens; the structured request is added once the compile is done, or
refused with a 400-shaped InvalidParameter when it runs past its budget."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from streamkv.engine.async_engine import AsyncEngine
from streamkv.engine.grammar_compiler import CompileCache
from streamkv.sampling_params import InvalidParameter, SamplingParams
from tests.entrypoints.fake_engine import FakeEngine

COMPILE_S = 1.0


class GrammarEngine(FakeEngine):
    """The fake engine with the real engine's grammar hand-off: compiles take COMPILE_S."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(step_delay=0.01)
        self.compile_threads: set[int] = set()
        self.cache = CompileCache(self._slow_compile, size=8, timeout_s=timeout_s)

    def _slow_compile(self, kind: str, text: str) -> str:
        self.compile_threads.add(threading.get_ident())
        time.sleep(COMPILE_S)
        return text

    def defer_until_compiled(self, params, resume) -> bool:
        return (
            self.cache.request(*params.structured_outputs.key(), resume)
            if params.structured_outputs
            else False
        )

    def add_request(self, request_id, prompt, params, prompt_token_ids=None, arrival_time=None):
        if params.structured_outputs is not None:
            self.cache.compile_now(*params.structured_outputs.key())  # the real engine's admit
        super().add_request(request_id, prompt, params, prompt_token_ids, arrival_time)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@pytest.mark.parametrize("timeout_s", [5.0, 0.3])
def test_a_slow_compile_never_stalls_other_streams(timeout_s: float) -> None:
    async def main() -> None:
        fake = GrammarEngine(timeout_s)
        engine = AsyncEngine(lambda: fake)
        engine.start()
        await engine.wait_ready()
        victim = await engine.add_request("victim", [1, 2], SamplingParams(max_tokens=10_000))
        arrivals: list[float] = []

        async def watch() -> None:
            async for _ in victim:
                arrivals.append(time.monotonic())

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        structured = SamplingParams(max_tokens=3, structured_outputs={"regex": "a+"})
        if timeout_s < COMPILE_S:
            with pytest.raises(InvalidParameter, match="took longer than"):
                await engine.add_request("grammar", [3], structured)
        else:
            stream = await engine.add_request("grammar", [3], structured)
            assert [o async for o in stream][-1].finished
        assert time.monotonic() - t0 >= min(timeout_s, COMPILE_S) * 0.9
        during = [t for t in arrivals if t >= t0]
        gaps = [b - a for a, b in zip(during, during[1:])]
        assert during and max(gaps) < 0.5, max(gaps)  # the victim streamed through the compile
        assert threading.get_ident() not in fake.compile_threads
        engine.abort("victim")
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await engine.stop()
        fake.cache.shutdown()

    _run(main())
