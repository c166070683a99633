"""The engine-thread watchdog (issue 26): a step that spins past its limit turns the engine's
health to "stuck" with the reason, is interrupted, and the engine comes back with the
suspected request ended by an error and the others resumed; stop() never waits forever on
a stuck engine thread."""

from __future__ import annotations

import asyncio
import time

import pytest

from streamkv.engine.async_engine import AsyncEngine
from streamkv.engine.recovery import EngineRestartedError
from streamkv.engine.request_book import EngineRecoveringError
from streamkv.sampling_params import SamplingParams
from tests.entrypoints.fake_engine import FakeEngine

HANG = 666  # a prompt holding this token makes the fake's step spin forever, in Python


class SpinningEngine(FakeEngine):
    def step(self, unread=(), emit=None):
        if any(HANG in r["ids"] for r in self.requests.values()):
            while True:  # what top_p=1e-46 did to the sampler's rounds
                pass
        return super().step(unread)


class NativeHang(FakeEngine):
    """A step stuck where no exception can reach it (a long native call): modelled by a
    sleep that ignores the watchdog's interrupt."""

    def step(self, unread=(), emit=None):
        if any(HANG in r["ids"] for r in self.requests.values()):
            while True:
                try:
                    time.sleep(60)
                except BaseException:  # noqa: BLE001 - a native call would not see it either
                    continue
        return super().step(unread)


class Recording(AsyncEngine):
    """Records what /health would have answered at each watchdog report."""

    def _on_stalled(self, why):
        super()._on_stalled(why)
        try:
            self.check_alive()
            self.reports.append((why, None))
        except EngineRecoveringError as e:
            self.reports.append((why, str(e)))

    reports: list = []


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_a_spinning_step_is_reported_broken_and_its_request_ended() -> None:
    async def main() -> None:
        builds = [SpinningEngine(step_delay=0.005), SpinningEngine(step_delay=0.005)]
        engine = Recording(lambda: builds.pop(0), step_timeout_s=0.5)
        engine.reports = []
        engine.start()
        await engine.wait_ready()
        victim = await engine.add_request("victim", [5, 6], SamplingParams(max_tokens=300))
        outs = []

        async def read() -> None:
            async for out in victim:
                outs.append(out)

        reader = asyncio.create_task(read())
        while not outs:
            await asyncio.sleep(0.01)
        hostile = await engine.add_request("hostile", [HANG], SamplingParams(max_tokens=5))
        with pytest.raises(EngineRestartedError, match="suspected"):
            async for _ in hostile:
                pass
        await asyncio.wait_for(reader, 10)
        assert (
            outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 300
        )  # resumed, nothing lost
        assert engine.ready and engine.stalled is None and not builds
        # While the step was stuck, /health's check said so (a 503 with the reason).
        why, health = engine.reports[0]
        assert (
            "limit is 0.5 s" in why and health is not None and "stuck" in health and why in health
        )
        await engine.stop()

    _run(main())


def test_stop_is_bounded_when_the_step_cannot_be_interrupted() -> None:
    async def main() -> None:
        engine = AsyncEngine(lambda: NativeHang(), step_timeout_s=0.3, stop_timeout_s=1.0)
        engine.start()
        await engine.wait_ready()
        await engine.add_request("hostile", [HANG], SamplingParams(max_tokens=5))
        t0 = time.monotonic()
        while engine.stalled is None and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.02)
        assert engine.stalled is not None and not engine.ready
        t0 = time.monotonic()
        await engine.stop()
        assert time.monotonic() - t0 < 3.0

    _run(main())


class WaitingEngine(FakeEngine):
    """A healthy step that waits (for the GIL under a burst, a worker, the device) past the
    limit without spinning: modelled by a sleep of twice the limit in its first step."""

    def __init__(self, wait_s: float, **kw) -> None:
        super().__init__(**kw)
        self.wait_s = wait_s

    def step(self, unread=(), emit=None):
        if self.wait_s:
            time.sleep(self.wait_s)
            self.wait_s = 0.0
        return super().step(unread)


def test_a_step_that_waits_without_spinning_is_not_broken() -> None:
    """The limit counts the engine thread's CPU time: on the 2-core box a burst of 4,000
    requests kept a healthy step waiting past 30 s of wall time, and 206 requests were ended."""

    async def main() -> None:
        builds = [WaitingEngine(1.0)]
        engine = AsyncEngine(lambda: builds.pop(0), step_timeout_s=0.4)
        engine.start()
        await engine.wait_ready()
        stream = await engine.add_request("patient", [5, 6], SamplingParams(max_tokens=4))
        outs = [out async for out in stream]
        assert (
            outs[-1].finished and outs[-1].error is None and len(outs[-1].outputs[0].token_ids) == 4
        )
        assert engine.stalled is None and not builds
        await engine.stop()

    _run(main())
