"""One step's input tensors, built on the host and sent in two copies.

Decode sequences (one new token) go first so that they form one batched paged-decode call;
prompt spans follow. Every per-token and per-sequence array is packed into two host
buffers, int64 and int32, so a step costs two host-to-device copies however many arrays
the attention metadata holds (the model runner calls ``prepare_step``).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from streamkv.layers.attention import AttentionMetadata
from streamkv.layers.sampled_batch import on_device
from streamkv.worker.input_batch import SeqInput


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
