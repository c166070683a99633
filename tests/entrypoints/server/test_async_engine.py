"""AsyncEngine on a fake engine: streams, aborts between steps, coalescing, engine death."""

from __future__ import annotations

import asyncio
import threading

import pytest

from streamkv.engine.async_engine import AsyncEngine
from streamkv.engine.recovery import RestartBudget
from streamkv.engine.request_book import EngineDeadError, EngineNotReadyError, RequestAbortedError
from streamkv.sampling_params import SamplingParams
from tests.entrypoints.fake_engine import CRASH_TOKEN, FakeEngine


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def started(fake: FakeEngine | None = None) -> tuple[AsyncEngine, FakeEngine]:
    fake = fake or FakeEngine()
    engine = AsyncEngine(lambda: fake)
    engine.start()
    await engine.wait_ready()
    return engine, fake


def test_stream_yields_cumulative_outputs_until_finished():
    async def main():
        engine, fake = await started()
        stream = await engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=5))
        outs = [out async for out in stream]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
        assert all(not o.finished for o in outs[:-1])
        lengths = [len(o.outputs[0].text) for o in outs]
        assert lengths == sorted(lengths)
        # Every engine call came from one thread, and not the event loop's.
        assert len(fake.thread_ids) == 1 and threading.get_ident() not in fake.thread_ids
        await engine.stop()

    run(main())


def test_bad_input_raises_value_error_and_engine_keeps_serving():
    async def main():
        engine, _ = await started()
        with pytest.raises(ValueError, match="empty"):
            await engine.add_request("bad", [], SamplingParams())
        stream = await engine.add_request("ok", [1], SamplingParams(max_tokens=2))
        assert [o async for o in stream][-1].finished
        await engine.stop()

    run(main())


def test_abort_reaches_engine_before_next_steps_and_ends_stream():
    async def main():
        engine, fake = await started(FakeEngine(step_delay=0.01))
        stream = await engine.add_request("r", [1], SamplingParams(max_tokens=10_000))
        it = stream.__aiter__()
        await it.__anext__()
        engine.abort("r")
        with pytest.raises(RequestAbortedError):
            await it.__anext__()
        steps_at_abort = fake.steps
        for _ in range(100):
            if "r" in fake.aborted:
                break
            await asyncio.sleep(0.005)
        assert fake.aborted == ["r"] and not fake.requests
        assert fake.steps - steps_at_abort <= 1  # at most the step already running
        await engine.stop()

    run(main())


def test_cancelled_add_is_aborted_once_accepted():
    async def main():
        engine, fake = await started(FakeEngine(step_delay=0.05))
        busy = await engine.add_request("busy", [1], SamplingParams(max_tokens=10_000))
        task = asyncio.ensure_future(
            engine.add_request("gone", [1], SamplingParams(max_tokens=10_000))
        )
        await asyncio.sleep(0)  # queued; the engine thread is inside a 50 ms step
        task.cancel()
        for _ in range(200):
            if "gone" in fake.aborted:
                break
            await asyncio.sleep(0.01)
        assert "gone" in fake.aborted
        engine.abort(busy.request_id)
        await engine.stop()

    run(main())


def test_slow_reader_gets_coalesced_outputs():
    async def main():
        engine, _ = await started(FakeEngine(step_delay=0.001))
        stream = await engine.add_request("r", [1], SamplingParams(max_tokens=60))
        seen = []
        async for out in stream:
            seen.append(out)
            await asyncio.sleep(0.02)
        assert seen[-1].finished and len(seen[-1].outputs[0].text) == 60
        assert len(seen) < 60  # the reader skipped intermediate outputs instead of queueing them
        await engine.stop()

    run(main())


def test_engine_death_fails_streams_and_later_requests():
    async def main():
        engine, _ = await started()
        alive = await engine.add_request("a", [1], SamplingParams(max_tokens=10_000))
        await engine.add_request("crash", [CRASH_TOKEN], SamplingParams())
        with pytest.raises(EngineDeadError):
            async for _ in alive:
                pass
        assert engine.dead is not None and not engine.ready
        with pytest.raises(EngineDeadError):
            await engine.add_request("after", [1], SamplingParams())
        await engine.stop()

    run(main())


def test_load_failure_and_not_ready():
    async def main():
        gate = threading.Event()

        def build():
            gate.wait(5)
            raise OSError("no such model")

        engine = AsyncEngine(build)
        engine.start()
        with pytest.raises(EngineNotReadyError):
            engine.check_alive()
        gate.set()
        with pytest.raises(EngineDeadError, match="no such model"):
            await engine.wait_ready()
        await engine.stop()

    run(main())


class DyingEngine(FakeEngine):
    """Its worker "dies" (WorkerError, as the mp executor raises it) at step ``die_at``."""

    def __init__(self, die_at: int | None, **kw) -> None:
        super().__init__(**kw)
        self.die_at = die_at
        self.added: list[str] = []

    def add_request(self, request_id, *args, **kw):
        super().add_request(request_id, *args, **kw)
        self.added.append(request_id)

    def step(self, unread=(), emit=None):
        if self.die_at is not None and self.steps >= self.die_at:
            from streamkv.executor.multiproc import WorkerError

            raise WorkerError("worker rank 0 (pid 1) was killed by SIGKILL")
        return super().step(unread)


def test_dead_worker_is_restarted_and_requests_resume_without_lost_or_repeated_text():
    async def main():
        control, _ = await started(FakeEngine(step_delay=0.001))
        expected = [
            o
            async for o in await control.add_request("c", [5, 6, 7], SamplingParams(max_tokens=40))
        ][-1]
        expected_n = [
            o
            async for o in await control.add_request("cw", [9], SamplingParams(max_tokens=100, n=2))
        ][-1]
        await control.stop()

        second = DyingEngine(die_at=None, step_delay=0.002)
        builds = [DyingEngine(die_at=12, step_delay=0.002), second]
        engine = AsyncEngine(lambda: builds.pop(0))
        engine.start()
        await engine.wait_ready()
        stream = await engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=40, logprobs=0))
        parallel = await engine.add_request("w", [9], SamplingParams(max_tokens=100, n=2))
        endless = await engine.add_request("x", [9], SamplingParams(max_tokens=10_000, n=3))
        texts = []
        async for out in stream:
            texts.append(out.outputs[0].text)
        final = out.outputs[0]
        assert (
            final.text == expected.outputs[0].text
            and final.token_ids == expected.outputs[0].token_ids
        )
        assert len(final.logprobs) == 40 and final.finish_reason == "length"
        assert all(
            b.startswith(a) for a, b in zip(texts, texts[1:], strict=False)
        )  # the text only grew
        assert out.prompt_token_ids == [5, 6, 7] and engine.ready and not builds
        # n > 1: each sample resumed as a request of its own, joined back in its place.
        samples = [o async for o in parallel]
        assert [c.index for c in samples[-1].outputs] == [0, 1] and samples[-1].finished
        assert [c.text for c in samples[-1].outputs] == [c.text for c in expected_n.outputs]
        assert [c.finish_reason for c in samples[-1].outputs] == ["length", "length"]
        assert samples[-1].request_id == "w" and samples[-1].prompt_token_ids == [9]
        assert {"r", "w#sample-0", "w#sample-1", "x#sample-0"} <= set(
            second.added
        ) and "w" not in second.added
        # Aborting such a request aborts every one of its samples in the engine.
        engine.abort("x")
        with pytest.raises(RequestAbortedError):
            async for _ in endless:
                pass
        for _ in range(100):
            if len(second.aborted) >= 3:
                break
            await asyncio.sleep(0.01)
        assert sorted(second.aborted) == ["x#sample-0", "x#sample-1", "x#sample-2"]
        await engine.stop()

    run(main())


def test_restarts_past_the_budget_kill_the_engine():
    async def main():
        engine = AsyncEngine(
            lambda: DyingEngine(die_at=1), restarts=RestartBudget(limit=2, window=60)
        )
        engine.start()
        await engine.wait_ready()
        stream = await engine.add_request("r", [1], SamplingParams(max_tokens=100))
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert "failed 2 times" in str(await engine.wait_dead())
        await engine.stop()

    run(main())
