"""Beam search as fork / append / free on a sequence group.

Each step every live beam returns its best candidate tokens; the group keeps the best
``beam_width`` continuations that do not end, forks a beam that continues more than once
(its blocks are shared, copy-on-write on the next write), and frees a beam that continues
not at all (its unshared blocks go back to the pool at once). Hypotheses that end (EOS or
the length limit) are scored ``sum logprob / generated_len ** length_penalty`` and the best
``beam_width`` are kept.

The selection and stopping rules follow Hugging Face transformers' ``generate(num_beams=k)``
exactly, so results can be compared token for token: candidates are the top
``max(2, 1 + #eos) * k`` continuations; only those among the top ``k`` may finish a
hypothesis; ``early_stopping=True`` stops once ``k`` hypotheses exist; ``False`` stops when
the best running beam, scored at its current length, cannot beat the worst kept hypothesis;
``"never"`` scores it at the maximum length instead (when length_penalty > 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from streamkv.messages import SampleResult
from streamkv.sampling_params import SamplingParams
from streamkv.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass(slots=True)
class BeamState:
    open: bool = True  # transformers' "early stop heuristic unsatisfied"
    done: bool = False


@dataclass(frozen=True, slots=True)
class BeamContext:
    """What beam search works with, passed in rather than reached for."""

    # (group, seq, token, logprob, the step's top logprobs): append a chosen token.
    add_token: Callable[[SequenceGroup, Sequence, int, float, list[tuple[int, float]] | None], None]
    fork: Callable[[Sequence, Sequence], None]  # the block manager's fork (shares blocks)
    new_seq_id: Callable[[], int]
    eos_token_ids: frozenset[int]
    max_model_len: int


def beams_to_keep(width: int, num_eos: int) -> int:
    return max(2, 1 + num_eos) * width


def ending_tokens(params: SamplingParams, eos_token_ids: frozenset[int]) -> set[int]:
    """Tokens that end a hypothesis: EOS (unless ignored) and stop_token_ids."""
    return (set() if params.ignore_eos else set(eos_token_ids)) | set(params.stop_token_ids)


def beam_step(
    ctx: BeamContext, group: SequenceGroup, results: list[tuple[Sequence, SampleResult]]
) -> None:
    params = group.sampling_params
    width = params.best_of
    state = group.beam_state
    # stop_token_ids end a hypothesis as EOS does (its stop_reason names the token).
    eos = ending_tokens(params, ctx.eos_token_ids)
    max_model_len = ctx.max_model_len
    max_new = params.max_tokens or max_model_len
    keep = beams_to_keep(width, len(eos))
    candidates = []  # (accumulated logprob, beam order, parent, token, token logprob)
    tops = {}  # parent seq id -> its step's top logprobs (when the request asked for them)
    for order, (seq, res) in enumerate(results):
        tops[seq.seq_id] = res.top_logprobs[0] if res.top_logprobs else None
        for token, lp in (res.candidates or [])[:keep]:
            candidates.append((seq.cumulative_logprob + lp, order, seq, token, lp))
    candidates.sort(key=lambda c: (-c[0], c[1]))
    candidates = candidates[:keep]
    gen_len = len(results[0][0].output_token_ids) + 1

    def ends(seq: Sequence, token: int) -> bool:
        return token in eos or gen_len >= max_new or len(seq) + 1 >= max_model_len

    # Finished hypotheses: only the top `width` candidates may end one.
    full = len(group.finished_beams) >= width
    if state.open and not (full and params.early_stopping is True):
        for score, _, seq, token, lp in candidates[:width]:
            if ends(seq, token):
                hyp = seq.fork(-1, seq.sample_index)
                ctx.add_token(group, hyp, token, lp, tops[seq.seq_id])
                hyp.status = (
                    SequenceStatus.FINISHED_STOPPED
                    if token in eos
                    else SequenceStatus.FINISHED_LENGTH
                )
                if token in params.stop_token_ids:
                    hyp.stop_reason = token
                hyp.beam_score = score / (gen_len**params.length_penalty)
                group.finished_beams.append(hyp)
        group.finished_beams.sort(key=lambda h: -h.beam_score)
        del group.finished_beams[width:]

    running = [c for c in candidates if not ends(c[2], c[3])][:width]
    _advance_beams(ctx, group, [seq for seq, _ in results], running, tops)

    # Whole-search stopping rule.
    full = len(group.finished_beams) >= width
    if running and state.open and full:
        if params.early_stopping == "never" and params.length_penalty > 0:
            best_len = max_new
        else:
            best_len = gen_len
        best_possible = running[0][0] / (best_len**params.length_penalty)
        state.open = best_possible > group.finished_beams[-1].beam_score
    if not state.open or (full and params.early_stopping is True) or not running:
        for seq in group.seqs:
            if not seq.status.finished:
                seq.status = SequenceStatus.FINISHED_LENGTH
        state.done = True


def _advance_beams(
    ctx: BeamContext, group: SequenceGroup, parents: list[Sequence], running, tops
) -> None:
    children: dict[int, list[tuple[int, float]]] = {}
    for _, _, seq, token, lp in running:
        children.setdefault(seq.seq_id, []).append((token, lp))
    new_seqs: list[Sequence] = []
    for parent in parents:
        picks = children.get(parent.seq_id)
        if not picks:
            parent.status = SequenceStatus.FINISHED_ABORTED  # dropped: blocks freed this step
            continue
        # Fork before appending: children share the parent's blocks as they are now.
        forks = []
        for token, lp in picks[1:]:
            child = parent.fork(ctx.new_seq_id(), parent.sample_index)
            ctx.fork(parent, child)
            forks.append((child, token, lp))
        top = tops[parent.seq_id]
        ctx.add_token(group, parent, *picks[0], top)
        new_seqs.append(parent)
        for child, token, lp in forks:
            ctx.add_token(group, child, token, lp, top)
            new_seqs.append(child)
    # Best first, as transformers orders its running beams. Dropped beams stay in the group
    # until the scheduler has freed their blocks at the end of this step.
    new_seqs.sort(key=lambda s: -s.cumulative_logprob)
    group.seqs = new_seqs + [p for p in parents if p.status.finished]


def ranked_beams(group: SequenceGroup) -> list[Sequence]:
    n = group.sampling_params.n
    if group.finished_beams:
        return group.finished_beams[:n]
    return sorted(group.live_seqs(), key=lambda s: -s.cumulative_logprob)[:n]
