"""The worker's persistent per-sequence state, updated by each StepInput's deltas.

A sequence's sampling parameters (a row of the SamplingTable's columns), block table and
(when it has a penalty) token counts are set up once, when it arrives in ``new_seqs``; later
steps only append tokens and block ids, and write the sampled rows' output positions in one
vectorized store. ``finished_ids`` frees a sequence's state, its table row and its
token-count row. The engine's StepBuilder mirrors what this holds, so the two never disagree
about which sequences are here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamkv.layers.penalties import TokenCounts
from streamkv.layers.sample_request import SampleRequest
from streamkv.layers.token_mask import TokenMask, mask_of
from streamkv.messages import PENDING_TOKEN, NewSeq, StepInput
from streamkv.worker.prompt_logprobs import PromptScoring, plan_scoring
from streamkv.worker.sampling_table import SamplingTable

__all__ = ["InputBatch", "ProtocolError", "SampleRequest", "SeqInput"]


@dataclass(slots=True)
class SeqInput:
    """One sequence's model input this step, as the model runner reads it."""

    seq_id: int
    token_ids: list[int]  # the tokens computed this step
    start_pos: int  # position of token_ids[0] (= tokens already cached)
    block_table: list[int]
    # What it samples: True for an InputBatch's input (its parameters are row ``slot`` of
    # the batch's SamplingTable), a SampleRequest for a hand-made one (tests, benchmarks);
    # None: a prompt chunk that samples nothing.
    sample: SampleRequest | bool | None = None
    # Its one input token is the one the previous step sampled for it (PENDING_TOKEN on the
    # wire): the model runner fills it in on the device, and counts it for penalties there.
    pending: bool = False
    scoring: PromptScoring | None = None  # prompt tokens to score (worker/prompt_logprobs.py)
    slot: int = -1  # its row in the SamplingTable (-1: a hand-made input)
    token_mask: TokenMask | None = None  # structured outputs: this step's allowed tokens


@dataclass(slots=True)
class _SeqState:
    slot: int  # its row in the SamplingTable
    reads_position: bool  # the sampler reads its output position (SamplingTable.advance)
    block_table: list[int]
    counts_row: int  # its token-count row (penalties only; else -1)
    num_counted: int  # tokens of its history in its token-count row
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
        self.sampling = SamplingTable(self.counts)

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
        # The sampling table's per-step entries: output positions, the rows with several samples.
        pos_rows, pos_ends, multi = [], [], {}
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
            pending = len(s.token_ids) == 1 and s.token_ids[0] == PENDING_TOKEN
            end = s.start_pos + len(s.token_ids)
            if state.counts_row >= 0 and end > state.num_counted:
                # Tokens past the counted history are outputs sampled since: count them (a
                # pending one on the device, by the model runner).
                if not pending:
                    new = s.token_ids[max(state.num_counted - s.start_pos, 0) :]
                    count_rows.extend([state.counts_row] * len(new))
                    count_tokens.extend(new)
                state.num_counted = end
            if s.sample:  # every rank: ranks that do not sample still join the logits' all-gather
                if state.reads_position:
                    pos_rows.append(state.slot)
                    pos_ends.append(end)
                if s.num_samples != 1:
                    multi[state.slot] = s.num_samples
                seq = SeqInput(
                    s.seq_id, s.token_ids, s.start_pos, table, True, pending, None, state.slot,
                    s.token_mask,
                )  # fmt: skip
            else:
                seq = SeqInput(s.seq_id, s.token_ids, s.start_pos, table, None, pending)
                seq.slot = state.slot
            if state.prompt is not None:
                seq.scoring = plan_scoring(
                    state.prompt, state.prompt_k, s.start_pos, len(s.token_ids)
                )
            out.append(seq)
        self.sampling.advance(pos_rows, pos_ends, multi)
        if count_rows:
            self.counts.add(count_rows, count_tokens)
        return out

    def _add(self, new: NewSeq) -> None:
        if new.seq_id in self.seqs:
            raise ProtocolError(f"sequence {new.seq_id} sent as new, but this worker holds it")
        p = new.params
        counts_row, counted, outputs_from = -1, 0, new.prompt_len - new.resumed
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
            counts_row = self.counts.allocate(history[:outputs_from], history[outputs_from:])
            counted = len(history)
        if p.prompt_logprobs is not None and new.history is None:
            raise ProtocolError(
                f"sequence {new.seq_id} asks for prompt logprobs but came without its prompt"
            )
        allowed = mask_of(p.allowed_token_ids, self.vocab_size) if p.allowed_token_ids else None
        slot = self.sampling.add(p, new.sample_index, outputs_from, counts_row, allowed)
        state = _SeqState(slot, SamplingTable.reads_position(p), [], counts_row, counted)
        self.seqs[new.seq_id] = state
        if p.prompt_logprobs is not None:
            state.prompt, state.prompt_k = new.history[: new.prompt_len], p.prompt_logprobs

    def _free(self, seq_id: int) -> None:
        state = self.seqs.pop(seq_id, None)
        if state is None:
            raise ProtocolError(f"sequence {seq_id} freed, but this worker does not hold it")
        self.sampling.free(state.slot)
        if state.counts_row >= 0:
            self.counts.free(state.counts_row)
