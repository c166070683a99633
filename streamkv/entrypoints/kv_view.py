"""GET /v1/kv/stream: the live KV-cache view's feed, as server-sent events (protocol in
docs/api.md, "KV-cache snapshot protocol").

One producer task takes the snapshots (core/kv_snapshot.py) on the engine thread, between
steps, and runs only while someone watches: with no viewer the engine does no extra work
at all. Every viewer gets the same encoded snapshot; a slow viewer skips snapshots rather
than queueing them. The period stretches when a snapshot gets costly, so that snapshots
never take more than ``max_duty`` of the engine thread's time, however large the pool.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import Response

from streamkv.core.kv_snapshot import take_snapshot
from streamkv.engine.async_engine import AsyncEngine
from streamkv.entrypoints.openai_protocol import APIError

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1


class _Viewer:
    """The newest snapshot not yet sent to one client (never more than one)."""

    def __init__(self) -> None:
        self.latest: str | None = None
        self.ready = asyncio.Event()

    def offer(self, text: str) -> None:
        self.latest = text
        self.ready.set()


class KVView:
    def __init__(self, engine: AsyncEngine, interval: float = 0.25, max_duty: float = 0.01,
                 max_viewers: int = 32, timeout: float = 5.0) -> None:
        self.engine, self.interval, self.max_duty = engine, interval, max_duty
        self.max_viewers, self.timeout = max_viewers, timeout
        self.viewers: set[_Viewer] = set()
        self._producer: asyncio.Task | None = None
        self._last: str | None = None  # the newest message sent
        self._last_body: str | None = None
        self.num_snapshots = 0  # taken since start (tests, and the "no viewer, no cost" claim)

    async def stream(self, request: Request) -> Response:
        """The endpoint (auth and the engine's liveness are checked by the caller's wrapper)."""
        self.engine.check_alive()
        if len(self.viewers) >= self.max_viewers:
            raise APIError(f"at most {self.max_viewers} KV-cache viewers at once", 429, "rate_limit_error",
                           code="too_many_viewers", headers={"retry-after": "5"})
        viewer = _Viewer()
        self.viewers.add(viewer)
        if self._last is not None:
            viewer.offer(self._last)
        if self._producer is None or self._producer.done():
            self._producer = asyncio.create_task(self._produce())
        return EventSourceResponse(self._events(viewer), ping=2, headers={"cache-control": "no-store"})

    async def _events(self, viewer: _Viewer) -> AsyncIterator[dict]:
        try:
            while True:
                await viewer.ready.wait()
                viewer.ready.clear()
                yield {"event": "kv_snapshot", "data": viewer.latest}
        finally:
            self.viewers.discard(viewer)

    async def _produce(self) -> None:
        period = self.interval
        try:
            while self.viewers and self.engine.dead is None:
                started = time.monotonic()
                taken = await self._take()
                if taken is not None:
                    snap, cost = taken
                    self.num_snapshots += 1
                    # Stretch the period so that snapshots stay under max_duty of the engine thread.
                    period = max(self.interval, cost / self.max_duty)
                    body = json.dumps(snap, separators=(",", ":"))
                    if body != self._last_body:  # an idle engine sends nothing new
                        self._last_body = body
                        head = json.dumps({"type": "kv_snapshot", "v": PROTOCOL_VERSION, "seq": self.num_snapshots,
                                           "interval_ms": round(period * 1000), "cost_ms": round(cost * 1000, 3)},
                                          separators=(",", ":"))
                        self._last = head[:-1] + "," + body[1:]
                        for viewer in self.viewers:
                            viewer.offer(self._last)
                await asyncio.sleep(max(0.0, period - (time.monotonic() - started)))
        except Exception:
            logger.exception("the KV-cache view stopped")
        finally:
            self._producer = None
            self._last = self._last_body = None  # stale once nobody watches

    async def _take(self) -> tuple[dict, float] | None:
        """One snapshot from the engine thread, with the seconds it took there."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def settle(result: tuple[dict, float] | BaseException) -> None:
            if done.done():
                return
            if isinstance(result, BaseException):
                done.set_exception(result)
            else:
                done.set_result(result)

        def on_engine_thread(engine) -> None:
            t0 = time.perf_counter()
            try:
                snap = take_snapshot(engine.block_manager, engine.scheduler).as_dict()
                result: tuple[dict, float] | BaseException = (snap, time.perf_counter() - t0)
            except Exception as e:
                result = e
            loop.call_soon_threadsafe(settle, result)

        self.engine.call_on_engine_thread(on_engine_thread)
        try:
            return await asyncio.wait_for(done, self.timeout)
        except asyncio.TimeoutError:
            return None  # the engine died or is stuck in a long step: try again next period
