"""Open-loop runs: requests leave at their arrival times whatever the server is doing, and
every driver fills the same per-request record, so one piece of code (metrics.py) measures
the HTTP+SSE API, the WebSocket and the offline engine alike.

Latencies are measured from a request's *scheduled* arrival, not from when the harness got
round to sending it, so a slow client or a long engine step can never hide queueing
(coordinated omission); how late each send was is reported on its own (``send_lag``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from load_tests.workloads import BenchRequest


@dataclass(slots=True)
class RequestRecord:
    index: int
    prompt_len: int
    output_len: int  # the workload's length per sample
    n: int
    scheduled: float  # seconds from the run's start
    sent: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # each delivery with new tokens
    end: float | None = None
    output_tokens: int = 0  # all samples together
    error: str | None = None
    incomplete: bool = False  # still running at the time limit, then cancelled

    @property
    def ok(self) -> bool:
        return self.end is not None and self.error is None and not self.incomplete


Clock = Callable[[], float]


class Driver(Protocol):
    """Sends one request and fills ``rec`` (chunk_times, end, output_tokens) by ``clock``."""

    async def send(self, req: BenchRequest, rec: RequestRecord, clock: Clock) -> None: ...


def new_record(i: int, req: BenchRequest, at: float) -> RequestRecord:
    return RequestRecord(i, req.prompt_len, req.output_len, max(req.n, req.beam_width, 1), at)


async def run_open_loop(
    driver: Driver,
    requests: list[BenchRequest],
    arrivals: list[float],
    max_duration: float,
    on_done: Callable[[RequestRecord], None] = lambda r: None,
) -> tuple[list[RequestRecord], float]:
    """Send each request at its arrival time (never after ``max_duration``); requests still
    running at ``max_duration`` are cancelled and marked incomplete. Returns the records and
    the run's length (first arrival to last completion)."""
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    records: list[RequestRecord] = []
    tasks: list[asyncio.Task] = []

    async def one(req: BenchRequest, rec: RequestRecord) -> None:
        rec.sent = clock()
        try:
            await driver.send(req, rec, clock)
            if rec.end is None:
                rec.end = clock()
        except asyncio.CancelledError:
            rec.incomplete = True
            raise
        except Exception as e:  # a failed request is a finding, not a crash of the harness
            rec.error = f"{type(e).__name__}: {e}"[:300]
            rec.end = clock()
        finally:
            on_done(rec)

    for i, (req, at) in enumerate(zip(requests, arrivals)):
        if at > max_duration:
            break
        delay = at - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        rec = new_record(i, req, at)
        records.append(rec)
        tasks.append(asyncio.create_task(one(req, rec)))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=max(max_duration - clock(), 0.0))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return records, run_length(records, clock())


def run_length(records: list[RequestRecord], now: float) -> float:
    ends = [r.end for r in records if r.end is not None and not r.incomplete]
    return max(ends + ([now] if any(r.incomplete for r in records) else [])) if records else 0.0
