"""GET /v1/kv/stream: the live KV-cache view's feed, as server-sent events (protocol in
docs/api.md, "KV-cache snapshot protocol").

One producer task takes the snapshots (core/kv_snapshot.py) on the engine thread, between
steps, and runs only while someone watches: with no viewer the engine does no extra work
at all. Every viewer gets the same encoded snapshot; a slow viewer skips snapshots rather
than queueing them. The period stretches when a snapshot gets costly, so that snapshots
never take more than ``max_duty`` of the engine thread's time, however large the pool.

Privacy (issue 26): the view showed every user's request ids (``cmpl-user-alice-medical-42``)
and block tables. Now a viewer sees the real id and sequence ids only of its own requests:
those whose request id holds the secret token it opened the stream with (``?token=``, 16 to
128 characters of ``[A-Za-z0-9_-]``; a client puts it in the ``request_id`` it sends). Every
other row is anonymous: its id and sequence ids are keyed hashes under a key of this viewer's
connection, stable while it watches (the page can follow a row) but linkable neither to the
request id nor across viewers. The route honours ``--api-key`` (the caller's wrapper) and is
off unless enabled, by default, when the server listens beyond loopback (app.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import Response

from streamkv.core.kv_snapshot import take_snapshot
from streamkv.engine.async_engine import AsyncEngine
from streamkv.entrypoints.openai.errors import APIError

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1


_TOKEN = re.compile(r"[A-Za-z0-9_-]{16,128}")


class _Viewer:
    """The newest snapshot not yet sent to one client (never more than one), and what tells
    its own requests from the others'."""

    def __init__(self, token: str | None) -> None:
        self.latest: str | None = None
        self.ready = asyncio.Event()
        self.token = token
        self._key = secrets.token_bytes(16)  # this connection's: anonymous labels stay unlinkable

    def offer(self, head: str, snap: dict) -> None:
        body = json.dumps(
            {**snap, "requests": [self._row(r) for r in snap["requests"]]}, separators=(",", ":")
        )
        self.latest = head[:-1] + "," + body[1:]
        self.ready.set()

    def _row(self, row: dict) -> dict:
        if self.token is not None and self.token in row["request_id"]:
            return {**row, "own": True}
        return {
            "request_id": "anon-" + self._label(row["request_id"]),
            "own": False,
            "seqs": [
                {**s, "seq_id": int(self._label(str(s["seq_id"]))[:7], 16)} for s in row["seqs"]
            ],
        }

    def _label(self, text: str) -> str:
        return hashlib.blake2b(
            text.encode("utf-8", "surrogatepass"), key=self._key, digest_size=8
        ).hexdigest()


class KVView:
    def __init__(
        self,
        engine: AsyncEngine,
        interval: float = 0.25,
        max_duty: float = 0.01,
        max_viewers: int = 32,
        timeout: float = 5.0,
        enabled: bool = True,
    ) -> None:
        self.engine, self.interval, self.max_duty, self.enabled = (
            engine,
            interval,
            max_duty,
            enabled,
        )
        self.max_viewers, self.timeout = max_viewers, timeout
        self.viewers: set[_Viewer] = set()
        self._producer: asyncio.Task | None = None
        self._last: tuple[str, dict] | None = None  # the newest message sent (head, snapshot)
        self._last_body: str | None = None
        self.num_snapshots = 0  # taken since start (tests, and the "no viewer, no cost" claim)

    async def stream(self, request: Request) -> Response:
        """The endpoint (auth and the engine's liveness are checked by the caller's wrapper)."""
        if not self.enabled:
            raise APIError(
                "the KV-cache view is off on this server (it listens beyond loopback; "
                "enable it explicitly)",
                404,
                "not_found_error",
                code="kv_view_disabled",
            )
        token = request.query_params.get("token")
        if token is not None and not _TOKEN.fullmatch(token):
            raise APIError(
                "'token' must be 16 to 128 characters of A-Z, a-z, 0-9, '_' and '-'", param="token"
            )
        self.engine.check_alive()
        if len(self.viewers) >= self.max_viewers:
            raise APIError(
                f"at most {self.max_viewers} KV-cache viewers at once",
                429,
                "rate_limit_error",
                code="too_many_viewers",
                headers={"retry-after": "5"},
            )
        viewer = _Viewer(token)
        self.viewers.add(viewer)
        if self._last is not None:
            viewer.offer(*self._last)
        if self._producer is None or self._producer.done():
            self._producer = asyncio.create_task(self._produce())
        return EventSourceResponse(
            self._events(viewer), ping=2, headers={"cache-control": "no-store"}
        )

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
                        head = json.dumps(
                            {
                                "type": "kv_snapshot",
                                "v": PROTOCOL_VERSION,
                                "seq": self.num_snapshots,
                                "interval_ms": round(period * 1000),
                                "cost_ms": round(cost * 1000, 3),
                            },
                            separators=(",", ":"),
                        )
                        self._last = (head, snap)
                        for viewer in self.viewers:
                            viewer.offer(head, snap)
                await asyncio.sleep(max(0.0, period - (time.monotonic() - started)))
        except Exception:
            logger.exception("the KV-cache view stopped")
        finally:
            self._producer = None
            self._last = self._last_body = None  # stale once nobody watches

    async def _take(self) -> tuple[dict, float] | None:
        """One snapshot from the engine, with the seconds it took there."""
        try:
            return await self.engine.run_on_engine(snapshot_of, self.timeout)
        except asyncio.TimeoutError:
            return None  # the engine died or is stuck in a long step: try again next period


def snapshot_of(engine) -> tuple[dict, float]:
    """The engine's KV snapshot (run where the engine runs) and the seconds it took."""
    t0 = time.perf_counter()
    snap = take_snapshot(engine.block_manager, engine.scheduler).as_dict()
    return snap, time.perf_counter() - t0
