"""After a step: advance each sequence's computed count, append sampled tokens (forking
parallel samples off a prompt), detokenize, apply stop conditions, free what finished, and
build RequestOutputs."""

from __future__ import annotations

import time
from collections.abc import Callable, Container

from streamkv.core.block_manager import BlockManager
from streamkv.core.step_plan import SchedulerOutput
from streamkv.engine import prompt_logprobs
from streamkv.engine.beam_search import BeamContext, beam_step, ranked_beams
from streamkv.engine.detokenizer import Detokenizer, check_stop_conditions, holdback
from streamkv.engine.structured import accept_tokens
from streamkv.messages import SampleResult, StepOutput
from streamkv.sequence import (
    CompletionOutput,
    Logprob,
    RequestOutput,
    Sequence,
    SequenceGroup,
    SequenceStatus,
    best_of_n,
)


class OutputProcessor:
    """Its collaborators, passed in: the block manager (mark computed blocks, fork samples),
    the scheduler's function that frees finished sequences, the source of new sequence ids,
    the served context length, the detokenizer and the EOS ids."""

    def __init__(
        self,
        block_manager: BlockManager,
        free_finished: Callable[[], None],
        new_seq_id: Callable[[], int],
        max_model_len: int,
        detokenizer: Detokenizer | None,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.bm = block_manager
        self.free_finished = free_finished
        self.new_seq_id = new_seq_id
        self.max_model_len = max_model_len
        self.detokenizer = detokenizer
        self.eos_token_ids = eos_token_ids
        self.beams = BeamContext(
            self.add_token, block_manager.fork, new_seq_id, eos_token_ids, max_model_len
        )

    def advance(self, sched: SchedulerOutput, pending: bool = False) -> None:
        """Count a step's tokens as computed and register its full blocks in the prefix cache.
        With async scheduling it runs once the step is handed off, and ``pending`` counts the
        token each sampling sequence is sampling (Sequence.num_pending), so the next step is
        planned while this one runs; a sequence that token ends by length gets none."""
        mark, max_len = self.bm.mark_computed, self.max_model_len
        for s in sched.scheduled:
            seq = s.seq
            if seq.status.finished:  # ended while the step ran (abort): its blocks are gone
                continue
            out = seq.output_token_ids
            n_out, computed = len(out), seq.num_computed_tokens + s.num_new_tokens
            length = len(seq.prompt_token_ids) + n_out
            seq.num_computed_tokens = computed
            mark(seq)
            if pending and computed == length:  # it samples (ScheduledSeq.do_sample)
                # Unless the token being sampled ends it by length, whatever it is (check_stop).
                max_tokens = s.group.sampling_params.max_tokens
                if (max_tokens is None or n_out + 1 < max_tokens) and length + 1 < max_len:
                    seq.num_pending = 1

    def apply(
        self, sched: SchedulerOutput, result: StepOutput, advanced: bool = False
    ) -> list[SequenceGroup]:
        """Apply a step's samples (``advanced``: ``advance`` already ran for this step): append
        the tokens, apply the stop conditions, free what finished. Returns the requests it
        touched, whose outputs ``build`` makes, at once or after the next step is submitted
        (engine/step_pipeline.py)."""
        if not advanced:
            self.advance(sched)
        results = result.results
        if result.prompt_logprobs:
            prompt_logprobs.record(sched.scheduled, result.prompt_logprobs)
        touched: dict[str, SequenceGroup] = {}
        beams: dict[str, list] = {}
        structured: list[tuple[SequenceGroup, Sequence, int]] = []  # grammars take all at once
        now = time.monotonic()
        for s in sched.scheduled:
            seq, group = s.seq, s.group
            if seq.num_pending:  # the sample below takes its place
                seq.num_pending = 0
            if seq.status.finished:
                # Aborted, or ended by the step before while this one ran (async scheduling):
                # this step's work for it is discarded, and its request was answered already.
                continue
            touched[group.request_id] = group
            res = results.get(seq.seq_id)
            if res is None:
                continue
            if group.first_token_time is None:
                group.first_token_time = now
            if group.sampling_params.use_beam_search:
                beams.setdefault(group.request_id, []).append((seq, res))
            elif len(res.token_ids) == 1:
                self.append_token(group, seq, res, 0, structured)
            else:
                self._append_samples(group, seq, res, structured)
        if structured:
            self._accept_structured(structured)
        for group in sched.failed:
            touched[group.request_id] = group
        self._end_step(touched, beams, now)
        return list(touched.values())

    def _end_step(
        self, touched: dict[str, SequenceGroup], beams: dict[str, list], now: float
    ) -> None:
        """After the samples are appended: the beam groups take their step, finished sequences
        are freed (a live beam group forgets its dropped beams), finished groups are timed."""
        for request_id, group_results in beams.items():
            beam_step(self.beams, touched[request_id], group_results)
        self.free_finished()
        for request_id in beams:
            group = touched[request_id]
            if not group.beam_state.done:
                group.seqs = [s for s in group.seqs if not s.status.finished]
        for group in touched.values():
            if group.finished and group.finished_time is None:
                group.finished_time = now

    def build(
        self, touched: list[SequenceGroup], finished_only: bool = False, unread: Container[str] = ()
    ) -> list[RequestOutput]:
        """The outputs of the requests ``touched``, but for running ones with ``finished_only``
        or in ``unread`` (their last output is not read yet: outputs are cumulative)."""
        make = self.make_output
        return [
            make(g) for g in touched if g.finished or not (finished_only or g.request_id in unread)
        ]

    def _append_samples(
        self, group: SequenceGroup, seq: Sequence, res: SampleResult, structured: list | None = None
    ) -> None:
        """Append one token per sample; a prompt's n>1 samples fork the sequence (each fork
        takes the grammar's state before the token: ``structured`` defers every accept)."""
        for j in range(1, len(res.token_ids)):
            child = seq.fork(self.new_seq_id(), sample_index=seq.sample_index + j)
            self.bm.fork(seq, child)
            group.seqs.append(child)
            self.append_token(group, child, res, j, structured)
        self.append_token(group, seq, res, 0, structured)

    def add_token(
        self,
        group: SequenceGroup,
        seq: Sequence,
        token: int,
        logprob: float,
        top: list[tuple[int, float]] | None = None,
    ) -> None:
        """Append a token chosen by the engine (beam search), with the top logprobs of the
        step it came from, and extend the text."""
        want = group.sampling_params.logprobs is not None
        seq.append_token(token, logprob, _logprob_entry(token, logprob, top) if want else None)
        if self.detokenizer is not None:
            self.detokenizer.update(seq, group.sampling_params.skip_special_tokens)

    def append_token(
        self,
        group: SequenceGroup,
        seq: Sequence,
        res: SampleResult,
        j: int,
        structured: list | None = None,
    ) -> None:
        token = res.token_ids[j]
        if group.sampling_params.logprobs is None:
            seq.output_token_ids.append(token)  # Sequence.append_token without logprobs, inline
            seq.cumulative_logprob += res.logprobs[j]
        else:
            top = _logprob_entry(
                token, res.logprobs[j], res.top_logprobs[j] if res.top_logprobs else None
            )
            seq.append_token(token, res.logprobs[j], top)
        self.check_stop(group, seq, structured)

    def check_stop(
        self, group: SequenceGroup, seq: Sequence, structured: list | None = None
    ) -> None:
        """Whether ``seq``'s last token ends it. A structured sequence's grammar takes the
        token first; with ``structured`` (a list) that is deferred: the sequence is appended
        to it, and ``_accept_structured`` finishes the check for all of a step's at once."""
        old_len = len(seq.output_text)
        if self.detokenizer is not None:
            self.detokenizer.update(seq, group.sampling_params.skip_special_tokens)
        grammar = seq.grammar
        if grammar is not None:
            if structured is not None:
                structured.append((group, seq, old_len))
                return
            if grammar.accept(seq.output_token_ids[-1]):  # structured outputs: it is complete
                seq.status = SequenceStatus.FINISHED_STOPPED
                return
        check_stop_conditions(
            seq, group.sampling_params, old_len, self.eos_token_ids, self.max_model_len
        )

    def _accept_structured(self, rows: list[tuple[SequenceGroup, Sequence, int]]) -> None:
        """check_stop's rest for a step's structured rows, their grammars advanced in one
        native call (structured.accept_tokens)."""
        ends = accept_tokens(
            [seq.grammar for _, seq, _ in rows], [seq.output_token_ids[-1] for _, seq, _ in rows]
        )
        for (group, seq, old_len), end in zip(rows, ends, strict=True):
            if end:
                seq.status = SequenceStatus.FINISHED_STOPPED
            else:
                check_stop_conditions(
                    seq, group.sampling_params, old_len, self.eos_token_ids, self.max_model_len
                )

    def make_output(self, group: SequenceGroup) -> RequestOutput:
        params = group.sampling_params
        seqs, stop, want_logprobs = group.seqs, params.stop, params.logprobs is not None
        if len(seqs) == 1 and not params.use_beam_search:  # the common case (per request per step)
            seq = seqs[0]
            finished = seq.status.finished
            index = 0 if finished else seq.sample_index
            completions = [_completion(index, seq, stop, want_logprobs)]
        else:
            finished = group.finished
            if params.use_beam_search:
                seqs = ranked_beams(group) if finished else seqs
            elif finished and params.best_of > params.n:
                seqs = best_of_n(seqs, params.n)
            completions = [
                _completion(i if finished else seq.sample_index, seq, stop, want_logprobs)
                for i, seq in enumerate(seqs)
            ]
        return RequestOutput(
            group.request_id,
            group.prompt,
            group.seqs[0].prompt_token_ids,
            completions,
            finished,
            group.error,
            _metrics(group),
            group.prompt_logprobs,
        )


def _completion(
    index: int, seq: Sequence, stop: list[str] | None, want_logprobs: bool
) -> CompletionOutput:
    """One sequence's output; a running one holds back text that may begin a stop string."""
    text, status = seq.output_text, seq.status
    if stop and not status.finished:
        text = text[: len(text) - holdback(text, stop)]
    return CompletionOutput(
        index,
        text,
        seq.output_token_ids[:],
        seq.cumulative_logprob,
        seq.output_logprobs[:] if want_logprobs else None,
        status.finish_reason,
        seq.stop_reason,
    )


def _metrics(group: SequenceGroup) -> dict[str, float]:
    metrics = {"arrival_time": group.arrival_time}
    if group.first_token_time is not None:
        metrics["first_token_time"] = group.first_token_time
    if group.finished_time is not None:
        metrics["finished_time"] = group.finished_time
    return metrics


def _logprob_entry(
    token: int, logprob: float, top: list[tuple[int, float]] | None
) -> dict[int, Logprob]:
    """The chosen token's logprob, plus the step's top ones ranked from 1 (the chosen token
    keeps its rank when it is among them)."""
    entry = {token: Logprob(logprob)}
    for rank, (tid, lp) in enumerate(top or (), start=1):
        if tid == token:
            entry[token].rank = rank
        else:
            entry.setdefault(tid, Logprob(lp, rank))
    return entry
