"""The app's lifespan: the engine starts with the server and stops with it, and a watch tells
serve's callbacks when the model is loaded (``ready:``) or the engine is dead (exit 1)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from starlette.applications import Starlette

from streamkv.engine.async_engine import AsyncEngine
from streamkv.engine.request_book import EngineDeadError
from streamkv.entrypoints.server.metrics import ServerMetrics
from streamkv.heap import freeze_heap

# app.py's logger, as before this moved here: operators' log filters name it.
logger = logging.getLogger("streamkv.entrypoints.server.app")


def make_lifespan(
    engine: AsyncEngine,
    metrics: ServerMetrics,
    on_failure: Callable[[], None] | None,
    on_ready: Callable[[], Awaitable[None]] | None,
):
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        engine.start()
        lag = asyncio.create_task(metrics.watch_loop_lag())
        watch = asyncio.create_task(watch_load(engine, on_failure, on_ready))
        try:
            yield
        finally:
            lag.cancel()
            watch.cancel()
            await engine.stop()

    return lifespan


async def watch_load(
    engine: AsyncEngine,
    on_failure: Callable[[], None] | None,
    on_ready: Callable[[], Awaitable[None]] | None = None,
) -> None:
    try:
        await engine.wait_ready()
    except EngineDeadError:
        if on_failure is not None:
            on_failure()
        return
    if on_ready is not None:  # /health answers 200 from now on: say so at once
        await on_ready()
    # Everything alive now (model, tokenizer, app) lives as long as the server (heap.py).
    freeze_heap()
    # A dead engine serves nothing: exit (non-zero) so that a supervisor restarts the server,
    # rather than answering 503 forever from a live process.
    error = await engine.wait_dead()
    logger.error(
        "the engine is dead (%s); the server exits with status 1", str(error).splitlines()[0]
    )
    if on_failure is not None:
        on_failure()
