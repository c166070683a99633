"""What one step of the scheduler plans, and the per-group rules it plans by: the tokens a
group's sequences compute within a budget (``demands``) and the decode rows a running group
adds to the step (``decode_rows``: decodes are scheduled before prompt chunks). Torch-free;
the scheduler
(core/scheduler.py) re-exports these names."""

from __future__ import annotations

from dataclasses import dataclass, field

from streamkv.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    group: SequenceGroup
    seq: Sequence
    num_new_tokens: int

    @property
    def do_sample(self) -> bool:
        return self.seq.num_computed_tokens + self.num_new_tokens == len(self.seq)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write
    failed: list[SequenceGroup] = field(default_factory=list)  # ended with an error
    num_preempted: int = 0

    # Rows that decode: one token past a computed prompt (set as the step is planned; a
    # prompt's last one-token chunk is not a decode, though it samples too).
    num_decodes: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.swap_in or self.swap_out or self.copies)


def demands(
    group: SequenceGroup, seqs: list[Sequence], budget: int
) -> list[tuple[Sequence, int]] | None:
    """Tokens each of ``seqs`` computes this step within ``budget``, or None if none can.

    A group of several splits the budget evenly: its sequences have equal lengths (they
    advance together), so they finish their chunks, and sample, in the same step, which beam
    search needs. After recompute the first sequence computes the shared prefix alone first.
    """
    if len(seqs) == 1:
        n = min(seqs[0].num_uncomputed_tokens, budget)
        return [(seqs[0], n)] if n > 0 else None
    leader = seqs[0]
    if leader.num_computed_tokens < group.num_shared_tokens:
        n = min(group.num_shared_tokens - leader.num_computed_tokens, budget)
        return [(leader, n)] if n > 0 else None
    share = budget // len(seqs)
    if share == 0:
        return None
    # A sequence with nothing to compute sits the step out (async scheduling: its next token
    # ends it by length, so the engine gave it no pending token).
    want = [(s, min(s.num_uncomputed_tokens, share)) for s in seqs]
    return [w for w in want if w[1] > 0] or None


def decode_rows(group: SequenceGroup) -> int | None:
    """The decode rows a running group puts into this step, or None while it still computes
    its prompt (a running sequence has more than one token to compute).

    A row is a running sequence with a token to compute; one with none waits for the step in
    flight to end it (async scheduling: its last token is being sampled). One pass over the
    group's sequences, no list: it runs per group per step.
    """
    seqs = group.seqs
    if len(seqs) == 1:
        seq = seqs[0]
        # len(seq) - computed, inline (per group per step)
        left = (
            len(seq.prompt_token_ids)
            + len(seq.output_token_ids)
            + seq.num_pending
            - seq.num_computed_tokens
        )
        if left > 1:
            return None
        return 1 if left and seq.status is SequenceStatus.RUNNING else 0
    rows = 0
    for seq in seqs:
        if seq.status is SequenceStatus.RUNNING:
            left = seq.num_uncomputed_tokens
            if left > 1:
                return None
            if left:
                rows += 1
    return rows
