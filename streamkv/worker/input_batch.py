"""The worker's persistent per-sequence state, updated by each StepInput's deltas.

A sequence's sampling parameters (a row of the SamplingTable's columns), block table and
(when it has a penalty) token counts are set up once, when it arrives in ``new_seqs``; later
steps only append tokens and block ids, and write the sampled rows' output positions in one
vectorized store. ``finished_ids`` frees a sequence's state, its table row and its
token-count row. The engine's StepBuilder mirrors what this holds, so the two never disagree
about which sequences are here.

``prepare_step`` turns a step's SeqInputs into its tensors. Decode sequences (one new token)
go first so that they form one batched paged-decode call; prompt spans follow. Every
per-token and per-sequence array is packed into two host buffers, int64 and int32, so a step
costs two host-to-device copies however many arrays the attention metadata holds.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from streamkv.layers.attention import AttentionMetadata
from streamkv.layers.penalties import TokenCounts
from streamkv.layers.sample_request import SampleRequest
from streamkv.layers.sampled_batch import on_device
from streamkv.layers.token_mask import TokenMask, mask_of
from streamkv.messages import PENDING_TOKEN, NewSeq, StepInput
from streamkv.worker.prompt_logprobs import PromptScoring, plan_scoring
from streamkv.worker.sampling_table import SamplingTable

__all__ = ["InputBatch", "ProtocolError", "SampleRequest", "SeqInput", "prepare_step"]


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


def prepare_step(
    seqs: list[SeqInput], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[SeqInput]]:
    """The step's tensors from two host buffers (two host-to-device copies): int64 input
    ids / positions / slots, and int32 context lengths, the prefill spans' cumulative
    query lengths and one padded block table of every sequence (decodes' rows first)."""
    decodes = [s for s in seqs if len(s.token_ids) == 1]
    ordered = decodes + [s for s in seqs if len(s.token_ids) > 1]
    n_seq, n_dec, bs = len(ordered), len(decodes), block_size
    lens = np.fromiter((len(s.token_ids) for s in ordered), np.int64, n_seq)
    starts = np.fromiter((s.start_pos for s in ordered), np.int64, n_seq)
    cu = np.zeros(n_seq + 1, np.int64)
    np.cumsum(lens, out=cu[1:])
    num_tokens = int(cu[-1])
    width = max((len(s.block_table) for s in ordered), default=1)
    tables = np.zeros((n_seq, width), np.int64)
    for i, s in enumerate(ordered):
        tables[i, : len(s.block_table)] = s.block_table

    host64 = np.empty((3, num_tokens), np.int64)
    ids, pos, slots = host64
    ids[:] = np.fromiter(
        itertools.chain.from_iterable(s.token_ids for s in ordered), np.int64, num_tokens
    )
    pos[:] = np.arange(num_tokens) + np.repeat(starts - cu[:-1], lens)
    slots[:] = tables[np.repeat(np.arange(n_seq), lens), pos // bs] * bs + pos % bs
    n_pre = n_seq - n_dec
    at_tables = n_seq + n_pre + 1  # host32: context lens | prefill cu | block tables
    host32 = np.empty(at_tables + n_seq * width, np.int32)
    host32[:n_seq] = starts + lens  # this step's tokens included
    host32[n_seq:at_tables] = cu[n_dec:] - cu[n_dec]
    host32[at_tables:] = tables.reshape(-1)

    dev64, dev32 = (on_device(device, torch.from_numpy(h)) for h in (host64, host32))
    input_ids, positions, slot_mapping = dev64.unbind(0)
    ctx, cu_prefill = dev32[:n_seq], dev32[n_seq:at_tables]
    dev_tables = dev32[at_tables:].view(n_seq, width)
    meta = AttentionMetadata(slot_mapping=slot_mapping, num_decode=n_dec)
    if n_dec:
        meta.decode_block_tables, meta.decode_context_lens = dev_tables[:n_dec], ctx[:n_dec]
        meta.decode_max_context_len = int(host32[:n_dec].max())
    if n_pre:
        meta.prefill_cu_query_lens = cu_prefill
        meta.prefill_context_lens, meta.prefill_block_tables = ctx[n_dec:], dev_tables[n_dec:]
    return input_ids, positions, meta, ordered
