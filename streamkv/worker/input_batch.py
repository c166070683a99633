"""The worker's persistent per-sequence state, updated by each StepInput's deltas.

A sequence's sampling parameters, block table and (when it has a penalty) token counts are
set up once, when it arrives in ``new_seqs``; later steps only append tokens and block ids.
``finished_ids`` frees a sequence's state and its token-count row. The engine's StepBuilder
mirrors what this holds, so the two never disagree about which sequences are here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamkv.layers.penalties import TokenCounts
from streamkv.layers.sample_request import SampleRequest
from streamkv.layers.token_mask import mask_of
from streamkv.messages import PENDING_TOKEN, NewSeq, StepInput
from streamkv.worker.prompt_logprobs import PromptScoring, plan_scoring


@dataclass(slots=True)
class SeqInput:
    """One sequence's model input this step, as the model runner reads it."""

    seq_id: int
    token_ids: list[int]  # the tokens computed this step
    start_pos: int  # position of token_ids[0] (= tokens already cached)
    block_table: list[int]
    sample: SampleRequest | None = None  # None: a prompt chunk that samples nothing
    # Its one input token is the one the previous step sampled for it (PENDING_TOKEN on the
    # wire): the model runner fills it in on the device, and counts it for penalties there.
    pending: bool = False
    scoring: PromptScoring | None = None  # prompt tokens to score (worker/prompt_logprobs.py)


@dataclass(slots=True)
class _SeqState:
    request: SampleRequest  # reused every step: only its per-step fields change
    prompt_len: (
        int  # tokens before its first output (a resumed request's earlier outputs are outputs)
    )
    min_tokens: int
    banned: list[int] | None
    block_table: list[int]
    num_counted: int  # tokens of its history in its token-count row (penalties only)
    prompt: list[int] | None = None  # with prompt logprobs only: the tokens they score
    prompt_k: int = 0  # ... and the top logprobs each one returns


class ProtocolError(RuntimeError):
    """A StepInput that does not fit the state its worker holds (an engine-side bug)."""


class InputBatch:
    def __init__(self, vocab_size: int, device: torch.device, samples: bool = True) -> None:
        self.seqs: dict[int, _SeqState] = {}
        self.vocab_size = vocab_size
        # Only a rank that samples needs token counts (tensor parallelism: rank 0).
        self.counts = TokenCounts(vocab_size, device) if samples else None

    def __len__(self) -> int:
        return len(self.seqs)

    def apply(self, step: StepInput) -> list[SeqInput]:
        """Free, then add, then advance; returns this step's model inputs in step order."""
        for seq_id in step.finished_ids:
            self._free(seq_id)
        for new in step.new_seqs:
            self._add(new)
        out = []
        count_rows, count_tokens = [], []
        for s in step.seqs:
            state = self.seqs.get(s.seq_id)
            if state is None:
                raise ProtocolError(
                    f"step for sequence {s.seq_id}, which this worker does not hold"
                )
            table = state.block_table
            if s.num_kept_blocks >= 0:
                if s.num_kept_blocks > len(table):
                    raise ProtocolError(
                        f"sequence {s.seq_id} keeps {s.num_kept_blocks} of its {len(table)} blocks"
                    )
                del table[s.num_kept_blocks :]
            table.extend(s.new_blocks)
            req = state.request
            pending = len(s.token_ids) == 1 and s.token_ids[0] == PENDING_TOKEN
            if req.counts is not None:
                # Tokens past the counted history are outputs sampled since: count them (a
                # pending one on the device, by the model runner).
                end = s.start_pos + len(s.token_ids)
                if end > state.num_counted:
                    if not pending:
                        new = s.token_ids[max(state.num_counted - s.start_pos, 0) :]
                        count_rows.extend([req.counts_row] * len(new))
                        count_tokens.extend(new)
                    state.num_counted = end
            sample = None
            if s.sample:  # every rank: ranks that do not sample still join the logits' all-gather
                sample = req
                req.num_samples = s.num_samples
                req.output_pos = pos = s.start_pos + len(s.token_ids) - state.prompt_len
                req.banned_token_ids = state.banned if pos < state.min_tokens else None
                req.token_mask = s.token_mask
            out.append(SeqInput(s.seq_id, s.token_ids, s.start_pos, table, sample, pending))
            if state.prompt is not None:
                out[-1].scoring = plan_scoring(
                    state.prompt, state.prompt_k, s.start_pos, len(s.token_ids)
                )
        if count_rows:
            self.counts.add(count_rows, count_tokens)
        return out

    def _add(self, new: NewSeq) -> None:
        if new.seq_id in self.seqs:
            raise ProtocolError(f"sequence {new.seq_id} sent as new, but this worker holds it")
        p = new.params
        req = SampleRequest(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            min_p=p.min_p,
            seed=p.seed,
            sample_index=new.sample_index,
            logprobs=p.logprobs,
            num_candidates=p.num_candidates,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            logit_bias=p.logit_bias,
            allowed_mask=mask_of(p.allowed_token_ids, self.vocab_size)
            if p.allowed_token_ids
            else None,
        )
        counted, outputs_from = 0, new.prompt_len - new.resumed
        if not 0 <= new.resumed < new.prompt_len:
            raise ProtocolError(
                f"sequence {new.seq_id} resumes {new.resumed} "
                f"outputs of a {new.prompt_len}-token prompt"
            )
        if p.has_penalties and self.counts is not None:
            if new.history is None:
                raise ProtocolError(
                    f"sequence {new.seq_id} has a penalty but came without its history"
                )
            history = new.history
            req.counts = self.counts
            req.counts_row = self.counts.allocate(history[:outputs_from], history[outputs_from:])
            counted = len(history)
        self.seqs[new.seq_id] = state = _SeqState(
            req, outputs_from, p.min_tokens, p.banned_token_ids, [], counted
        )
        if p.prompt_logprobs is not None:
            if new.history is None:
                raise ProtocolError(
                    f"sequence {new.seq_id} asks for prompt logprobs but came without its prompt"
                )
            state.prompt, state.prompt_k = new.history[: new.prompt_len], p.prompt_logprobs

    def _free(self, seq_id: int) -> None:
        state = self.seqs.pop(seq_id, None)
        if state is None:
            raise ProtocolError(f"sequence {seq_id} freed, but this worker does not hold it")
        if state.request.counts is not None:
            self.counts.free(state.request.counts_row)
