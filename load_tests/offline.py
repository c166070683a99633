"""The offline driver: an LLMEngine in this process, fed each request at its arrival time
between steps, recording into the same RequestRecords as the server drivers. No server, no
event loop: the figures are the engine's own (the paper's setting for its Fig 12)."""

from __future__ import annotations

import time
from collections.abc import Callable

from load_tests.runner import RequestRecord, new_record, run_length
from load_tests.sim import VirtualClock
from load_tests.workloads import BenchRequest
from streamkv.sampling_params import SamplingParams


def sampling_params(req: BenchRequest) -> SamplingParams:
    if req.beam_width:
        return SamplingParams(
            n=req.beam_width,
            best_of=req.beam_width,
            use_beam_search=True,
            temperature=0.0,
            max_tokens=req.output_len,
            ignore_eos=True,
        )
    return SamplingParams(n=req.n, temperature=1.0, max_tokens=req.output_len, ignore_eos=True)


def run_offline(
    engine,
    requests: list[BenchRequest],
    arrivals: list[float],
    max_duration: float,
    on_done: Callable[[RequestRecord], None] = lambda r: None,
    virtual: VirtualClock | None = None,
    on_all_arrived: Callable[[], None] = lambda: None,
    on_step: Callable[[float], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """The open loop of runner.run_open_loop with the engine stepped in this thread: a request
    due during a step is added right after it (its latency still counts from its arrival).
    With a ``virtual`` clock (sim.py: the executor advances it) waiting advances it too.
    ``on_all_arrived`` runs once, right after the last request is added (the end of the
    window in which the load is offered; what follows is the queue draining). ``on_step``
    gets each engine.step() call's time on the run's clock (load_tests/steps.py)."""
    base, clock, sleep = _clocks(virtual)
    records: list[RequestRecord] = []
    active: dict[str, RequestRecord] = {}
    todo = [(at, i) for i, at in enumerate(arrivals[: len(requests)]) if at <= max_duration]
    nxt = 0
    while True:
        now = clock()
        if now > max_duration:
            for rid, rec in active.items():
                engine.abort_request(rid)
                rec.incomplete = True
                on_done(rec)
            break
        while nxt < len(todo) and todo[nxt][0] <= now:
            at, i = todo[nxt]
            nxt += 1
            req, rec = requests[i], new_record(i, requests[i], at)
            rec.sent = now
            records.append(rec)
            active[str(i)] = rec
            engine.add_request(
                str(i),
                None,
                sampling_params(req),
                prompt_token_ids=req.prompt_ids,
                arrival_time=base + at,
            )
            if nxt == len(todo):
                on_all_arrived()
        if engine.has_unfinished_requests():
            t_step = clock()
            outputs = engine.step()
            t = clock()
            if on_step is not None:
                on_step(t - t_step)
            _record_outputs(outputs, t, active, on_done)
        elif nxt < len(todo):
            sleep(min(max(todo[nxt][0] - clock(), 0.0), max(max_duration - clock(), 0.0)) + 1e-4)
        else:
            break
    return records, run_length(records, clock())


def _clocks(
    virtual: VirtualClock | None,
) -> tuple[float, Callable[[], float], Callable[[float], None]]:
    """(base, clock, sleep): the engine's time of the run's start, the seconds since then, and
    a wait; on the wall clock, or on ``virtual``, where waiting advances it."""
    if virtual is None:
        t0 = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - t0

        def sleep(seconds: float) -> None:
            time.sleep(seconds)

        return time.monotonic(), clock, sleep
    base = virtual()  # the engine orders requests by arrival on the same clock

    def virtual_clock() -> float:
        return virtual() - base

    return base, virtual_clock, virtual.advance


def _record_outputs(
    outputs: list,
    t: float,
    active: dict[str, RequestRecord],
    on_done: Callable[[RequestRecord], None],
) -> None:
    """One step's outputs into their records, at time ``t``: a chunk where tokens came, the
    end where a request finished (it leaves ``active``)."""
    for out in outputs:
        rec = active.get(out.request_id)
        if rec is None:
            continue
        ntok = sum(len(c.token_ids) for c in out.outputs)
        if ntok > rec.output_tokens:
            rec.chunk_times.append(t)
            rec.output_tokens = ntok
        if out.finished:
            rec.end, rec.error = t, out.error
            del active[out.request_id]
            on_done(rec)
