"""Decodes first: every decode row of the running groups (``decode_rows``, checked against a
direct recount) is scheduled in a step that preempts nothing, whatever prompts wait, across
admission, chunked prompts, parallel samples (n > 1), beam-style fork and drop, preemption by
swap and by recompute, aborts, and async scheduling's sequences that have nothing to compute
this step."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from streamkv.core.step_plan import decode_rows
from streamkv.sampling_params import SamplingParams
from streamkv.sequence import Sequence, SequenceGroup, SequenceStatus
from tests.core.sched_helpers import Sim, make_bm, make_scheduler

RUNNING = SequenceStatus.RUNNING


def recount(groups: list[SequenceGroup]) -> int | None:
    """By the definition, with lists: a group decodes when none of its running sequences has
    more than one token to compute; its rows are the running ones with a token to compute.
    None when no group decodes."""
    decoding = []
    for g in groups:
        running = [s for s in g.seqs if s.status == RUNNING] if len(g.seqs) > 1 else g.seqs
        if all(s.num_uncomputed_tokens <= 1 for s in running):
            decoding.append(
                [s for s in running if s.status == RUNNING and s.num_uncomputed_tokens != 0]
            )
    return sum(len(rows) for rows in decoding) if decoding else None


def group_of(*seqs: Sequence) -> SequenceGroup:
    return SequenceGroup(
        "g", list(seqs), SamplingParams(n=len(seqs), temperature=1.0), arrival_time=0.0
    )


def seq(seq_id: int, length: int, computed: int, status: SequenceStatus = RUNNING) -> Sequence:
    return Sequence(seq_id, list(range(length)), status=status, num_computed_tokens=computed)


def test_decode_rows_of_single_groups_and_beams():
    assert decode_rows(group_of(seq(1, 8, 7))) == 1
    assert decode_rows(group_of(seq(1, 8, 8))) == 0  # waits for the step in flight
    assert decode_rows(group_of(seq(1, 8, 3))) is None  # a prompt chunk
    # Beams: a dropped beam stays in the group (finished) until its blocks are freed.
    beams = group_of(
        seq(1, 9, 8), seq(2, 9, 8), seq(3, 9, 2, SequenceStatus.FINISHED_ABORTED), seq(4, 9, 9)
    )
    assert decode_rows(beams) == 2
    # After recompute the first sequence computes the shared prefix alone: still a prompt.
    assert decode_rows(group_of(seq(1, 9, 4), seq(2, 9, 0))) is None
    assert decode_rows(group_of(seq(1, 9, 0, SequenceStatus.FINISHED_STOPPED), seq(2, 9, 8))) == 1


class CheckedSim(Sim):
    """Sim whose every step checks ``decode_rows`` against ``recount``, and that a step which
    preempts nothing schedules every decode row."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.held: list[tuple[Sequence, int]] = []
        self.checked = 0
        self._fork_ids = itertools.count(50_000)

    def step(self):
        expected = recount(self.sched.running)
        rows = [decode_rows(g) for g in self.sched.running]
        counted = [n for n in rows if n is not None]
        assert (sum(counted) if counted else None) == expected
        decoding = {id(g) for g, n in zip(self.sched.running, rows) if n}
        fits = (
            sum(len(g.live_seqs(RUNNING)) for g in self.sched.running)
            <= self.sched.config.max_num_seqs
        )
        out = super().step()
        if expected and out.num_preempted == 0 and not out.failed:
            ran = sum(1 for s in out.scheduled if id(s.group) in decoding)
            if fits:
                assert ran == expected, (ran, expected)
                self.checked += 1
        # The step "in flight" ends: a held token arrives (async scheduling).
        for s, token in self.held:
            if not s.status.finished:
                s.output_token_ids.append(token)
        self.held = []
        return out

    def _decoding_seqs(self) -> list[tuple[SequenceGroup, Sequence]]:
        return [
            (g, s)
            for g in self.sched.running
            for s in g.seqs
            if s.status is RUNNING and s.num_uncomputed_tokens == 1 and s.output_token_ids
        ]

    def fork(self, k: int) -> None:
        """A beam continuing twice: its child shares its blocks."""
        cands = self._decoding_seqs()
        if cands:
            group, parent = cands[k % len(cands)]
            if len(group.seqs) < self.sched.config.max_num_seqs:
                child = parent.fork(next(self._fork_ids), parent.sample_index)
                self.bm.fork(parent, child)
                group.seqs.append(child)

    def drop(self, k: int) -> None:
        """A beam that does not continue: finished, left in the group until freed."""
        cands = [(g, s) for g, s in self._decoding_seqs() if len(g.live_seqs(RUNNING)) > 1]
        if cands:
            cands[k % len(cands)][1].status = SequenceStatus.FINISHED_ABORTED

    def hold(self, k: int) -> None:
        """Async scheduling: the sequence's next token is sampled by the step in flight and
        ends it, so it has nothing to compute in the step being planned."""
        cands = [(g, s) for g, s in self._decoding_seqs() if (g, s) not in self.held]
        if cands:
            s = cands[k % len(cands)][1]
            self.held.append((s, s.output_token_ids.pop()))


events = st.lists(
    st.tuples(
        st.sampled_from(["add", "step", "step", "step", "abort", "fork", "drop", "hold"]),
        st.integers(1, 30),
        st.integers(1, 10),
        st.integers(1, 3),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    events=events, mode=st.sampled_from(["swap", "recompute"]), budget=st.sampled_from([8, 16, 64])
)
def test_decode_rows_equal_a_recount_every_step(events, mode, budget):
    bm = make_bm(num_blocks=16, block_size=4, cpu_blocks=8)
    sim = CheckedSim(make_scheduler(bm, budget=budget, max_num_seqs=6, mode=mode))
    live: list[str] = []
    for i, (kind, size, out_len, n) in enumerate(events):
        if kind == "add":
            live.append(sim.add(f"r{i}", size, max_tokens=out_len, n=n, token=i % 3).request_id)
        elif kind == "abort" and live:
            sim.sched.abort(live.pop(size % len(live)))
        elif kind in ("fork", "drop", "hold"):
            getattr(sim, kind)(size)
        else:
            sim.step()
    sim.run(max_steps=3000)
    assert not sim.sched.has_unfinished()
    bm.check_no_leaks()


def test_the_recount_sees_decodes_preemptions_and_forks():
    """A fixed run that exercises every case the random one may miss: decode rows counted with
    parallel samples decoding, a group is preempted, beams fork and drop, a token is held."""
    bm = make_bm(num_blocks=10, block_size=4, cpu_blocks=8)
    sim = CheckedSim(make_scheduler(bm, budget=16, max_num_seqs=6, mode="swap"))
    sim.add("a", 6, max_tokens=8, n=3)
    sim.add("b", 9, max_tokens=8)
    # Group a (three samples) runs first in the running list, b last.
    for action in (
        "step",
        "step",
        "hold 0",
        "fork 0",
        "drop 1",
        "hold 1",
        "hold 0",
        "fork 2",
        "hold 4",
        "drop 0",
        "fork 1",
        "hold 2",
    ):
        if action != "step":
            name, k = action.split()
            getattr(sim, name)(int(k))
        sim.step()
    sim.run(max_steps=500)
    assert sim.checked >= 5
    assert sim.sched.num_preemptions >= 1
    bm.check_no_leaks()
