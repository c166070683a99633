"""Builds each step's StepInput from the scheduler's output, sending the worker only what it
does not hold yet (see streamkv/messages.py).

The builder mirrors the worker's InputBatch: it remembers every sequence it has sent as new,
with the block table the worker holds for it and where its next step must start. Each step:

- a sequence it remembers that is no longer running (finished, aborted, dropped beam,
  swapped out, preempted by recompute) is sent in ``finished_ids`` and forgotten;
- a scheduled sequence it does not remember (new, forked, swapped back in) is sent whole as
  a NewSeq; so is one whose step starts before where its last one ended: it was recomputed
  after a preemption this builder did not see (a step with nothing to run is never built);
- every scheduled sequence sends its tokens and its block-table change: how many entries
  of the table it sent last still hold, then the new tail (usually one block or none).

A sequence that finishes in the last step waits in the worker until the next step frees it.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamkv.core.step_plan import SchedulerOutput
from streamkv.engine.beam_search import beams_to_keep, ending_tokens
from streamkv.messages import MASK_FOLLOWS, PENDING_TOKEN, NewSeq, SeqParams, SeqStep, StepInput
from streamkv.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass(slots=True)
class _Sent:
    seq: Sequence
    table: list[int]  # the block table as the worker holds it
    next_start: int  # where this sequence's next step starts, if nothing reset it


class StepBuilder:
    def __init__(self, block_tables: dict[int, list[int]], eos_token_ids: frozenset[int]) -> None:
        self.block_tables = block_tables  # the block manager's own, read only
        self.eos_token_ids = eos_token_ids
        self.sent: dict[int, _Sent] = {}  # seq_id -> what the worker holds

    def build(self, sched: SchedulerOutput) -> StepInput:
        step = StepInput(swap_in=sched.swap_in, swap_out=sched.swap_out, copies=sched.copies)
        running = SequenceStatus.RUNNING
        gone = [i for i, s in self.sent.items() if s.seq.status is not running]
        for seq_id in gone:
            del self.sent[seq_id]
        step.finished_ids = gone
        tables, sent = self.block_tables, self.sent
        append = step.seqs.append
        for s in sched.scheduled:
            seq, n = s.seq, s.num_new_tokens
            seq_id, start = seq.seq_id, seq.num_computed_tokens
            known = sent.get(seq_id)
            if known is None or start < known.next_start:
                if known is not None:
                    step.finished_ids.append(seq_id)
                step.new_seqs.append(self._new_seq(s.group, seq))
                known = sent[seq_id] = _Sent(seq, [], start)
            # Sequence.token_at / token_window and ScheduledSeq.do_sample, inline (per row per
            # step). A sequence with a pending token (async scheduling) has only that one to
            # compute, and samples: the worker takes it from the step before's samples.
            out = seq.output_token_ids
            i = start - len(seq.prompt_token_ids)  # where the step starts in the outputs
            if seq.num_pending:
                tokens, sample = [PENDING_TOKEN], True
            elif n == 1:
                tokens = [out[i] if i >= 0 else seq.prompt_token_ids[start]]
                sample = i + 1 == len(out)
            else:
                tokens = seq.token_window(start)[:n]
                sample = i + n == len(out)
            item = SeqStep(seq_id, tokens, start, sample)
            table, prev = tables[seq_id], known.table
            n_prev, n_table = len(prev), len(table)
            if n_table == n_prev and table == prev:  # unchanged: most steps
                pass
            elif n_prev < n_table and table[:n_prev] == prev:  # grown
                item.new_blocks = table[n_prev:]
                prev.extend(item.new_blocks)
            else:  # a block replaced (copy-on-write) or the table shrank
                keep = _common_prefix(prev, table)
                item.num_kept_blocks, item.new_blocks = keep, table[keep:]
                known.table = list(table)
            if sample:
                group = s.group
                p = group.sampling_params
                if not out and len(group.seqs) == 1 and not p.use_beam_search:
                    item.num_samples = p.best_of
                if seq.grammar is not None:  # structured outputs: the tokens it may sample
                    # Of the state after its input token: a pending one is not accepted yet.
                    item.token_mask = MASK_FOLLOWS if seq.num_pending else seq.grammar.mask_bytes()
            known.next_start = start + n
            append(item)
        return step

    def _new_seq(self, group: SequenceGroup, seq: Sequence) -> NewSeq:
        params = self._seq_params(group)
        # Penalties count the whole history; prompt logprobs score the prompt with it.
        wants = params.has_penalties or params.prompt_logprobs is not None
        history = seq.prompt_token_ids + seq.output_token_ids if wants else None
        return NewSeq(
            seq.seq_id,
            params,
            len(seq.prompt_token_ids),
            seq.sample_index,
            history,
            group.sampling_params.resumed_output_tokens,
        )

    def _seq_params(self, group: SequenceGroup) -> SeqParams:
        p = group.sampling_params
        banned = None
        if p.min_tokens:
            banned = (
                sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids))
                or None
            )
        return SeqParams(
            temperature=0.0 if p.greedy else p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            min_p=p.min_p,
            seed=p.seed,
            logprobs=p.logprobs,
            num_candidates=beams_to_keep(p.best_of, len(ending_tokens(p, self.eos_token_ids)))
            if p.use_beam_search
            else 0,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            logit_bias=p.logit_bias,
            # A resumed request's min_tokens is what it had left; the worker counts from the start.
            min_tokens=p.min_tokens + p.resumed_output_tokens if banned else 0,
            banned_token_ids=banned,
            prompt_logprobs=p.prompt_logprobs,
            allowed_token_ids=p.allowed_token_ids,
        )


def _common_prefix(prev: list[int], table: list[int]) -> int:
    k, limit = 0, min(len(prev), len(table))
    while k < limit and prev[k] == table[k]:
        k += 1
    return k
