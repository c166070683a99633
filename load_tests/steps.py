"""Per-step records of a run, for fitting the simulator's StepCost (load_tests/fit_steps.py):
each engine step's time beside what it computed.

The recorder wraps the executor's ``submit`` (what each step sent: tokens computed, context
tokens read, KV blocks touched) and the harness reports each ``engine.step()`` call's time.
A call's time goes to the steps submitted during it. With async scheduling a call submits
step N+1 and waits for step N, so in steady state a call lasts one device step and the pair
is off by one step; consecutive steps of a run differ little, and the fit averages over
thousands of them.

Memory is bounded: a seeded reservoir keeps a uniform sample of ``capacity`` steps whatever
the run's length, plus the count and total time of every step. The cost is one pass over a
step's sequences on the engine's thread: 25 us for 256 sequences on the 2-core box, against
the H200's ~10 ms steps.
"""

from __future__ import annotations

import random
from dataclasses import astuple, dataclass, fields

from streamkv.messages import StepInput


@dataclass(slots=True)
class StepRecord:
    seconds: float  # the engine.step() call's wall (or virtual) time
    seqs: int  # sequences in the step
    computed: int  # tokens computed (prompt chunks + one per decoding sequence)
    context: int  # context tokens the attention reads (cached + computed)
    blocks: int  # KV blocks those contexts span
    swapped: int = 0  # blocks swapped in or out


FIELDS = tuple(f.name for f in fields(StepRecord))


def summarize_step(step: StepInput, block_size: int) -> StepRecord:
    computed = context = blocks = 0
    for s in step.seqs:
        n = s.start_pos + len(s.token_ids)
        computed += len(s.token_ids)
        context += n
        blocks += -(-n // block_size)
    return StepRecord(
        0.0, len(step.seqs), computed, context, blocks, len(step.swap_in) + len(step.swap_out)
    )


class StepRecorder:
    def __init__(self, block_size: int, capacity: int = 4000, seed: int = 0) -> None:
        self.block_size, self.capacity = block_size, capacity
        self.rng = random.Random(seed)
        self.kept: list[StepRecord] = []
        self.seen = 0
        self.total_seconds = 0.0
        self._pending: list[StepRecord] = []

    def reset(self) -> None:
        """Start a new run's sample (the engine, and the wrapped executor, stay)."""
        self.kept, self.seen, self.total_seconds = [], 0, 0.0
        self._pending.clear()

    def attach(self, executor) -> None:
        """Record what each step sends to ``executor`` (the engine calls its ``submit``)."""
        submit = executor.submit

        def recording_submit(step: StepInput):
            self._pending.append(summarize_step(step, self.block_size))
            return submit(step)

        executor.submit = recording_submit

    def stepped(self, seconds: float) -> None:
        """One engine.step() call took ``seconds``: it goes to the steps submitted during it
        (summed: a call that submits two steps is one record of both)."""
        if not self._pending:
            return
        rec = self._pending[0]
        for p in self._pending[1:]:
            rec = StepRecord(
                0.0,
                rec.seqs + p.seqs,
                rec.computed + p.computed,
                rec.context + p.context,
                rec.blocks + p.blocks,
                rec.swapped + p.swapped,
            )
        self._pending.clear()
        rec.seconds = seconds
        self.seen += 1
        self.total_seconds += seconds
        if len(self.kept) < self.capacity:
            self.kept.append(rec)
        else:  # reservoir sampling (Algorithm R): every step kept with probability capacity / seen
            j = self.rng.randrange(self.seen)
            if j < self.capacity:
                self.kept[j] = rec

    def as_dict(self) -> dict:
        return {
            "fields": list(FIELDS),
            "rows": [list(astuple(r)) for r in self.kept],
            "steps": self.seen,
            "total_seconds": self.total_seconds,
            "block_size": self.block_size,
            "sample": f"uniform reservoir of at most {self.capacity} steps",
        }


def records_from_dict(d: dict) -> list[StepRecord]:
    idx = [d["fields"].index(name) for name in FIELDS]
    return [StepRecord(*(row[i] for i in idx)) for row in d["rows"]]
