"""What travels between the engine and its worker processes, and how.

Every message is a tuple of plain values (ints, floats, strings, lists, tuples, dicts,
None) serialised with pickle and read back by an unpickler that refuses every global: a
message can only ever become plain data, never an arbitrary object, even if a peer is
broken. The records of worker/messages.py are flattened to tuples on the way out and
rebuilt on the way in.

Block tables travel as deltas. Both ends keep the table each sequence had in the previous
step; a sequence sends how many leading entries of that table still hold plus the new tail
(usually ``(len, [])`` or ``(len, [new block])``). Both ends then keep only the sequences of
this step, so the two copies stay identical without any extra bookkeeping message; a
sequence that skips a step (swapped out, say) simply sends its whole table next time.
"""

from __future__ import annotations

import io
import pickle

from streamkv.worker.messages import SampleRequest, SampleResult, SeqInput, StepInput, StepOutput

_SAMPLE_FIELDS = SampleRequest.__slots__


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"refusing {module}.{name}: IPC messages are plain data only")


def dumps(message: tuple) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> tuple:
    return _PlainUnpickler(io.BytesIO(data)).load()


class StepEncoder:
    """Engine side: StepInput -> plain tuple, block tables as deltas."""

    def __init__(self) -> None:
        self._tables: dict[int, list[int]] = {}

    def encode(self, step: StepInput) -> tuple:
        seqs, tables = [], {}
        for s in step.seqs:
            table = s.block_table
            prev = self._tables.get(s.seq_id, [])
            keep = _common_prefix(prev, table)
            sample = None if s.sample is None else tuple(getattr(s.sample, f) for f in _SAMPLE_FIELDS)
            seqs.append((s.seq_id, s.token_ids, s.start_pos, keep, table[keep:], sample))
            tables[s.seq_id] = list(table)  # a copy: the caller may grow its list in place
        self._tables = tables
        return ("step", seqs, step.swap_in, step.swap_out, step.copies)


class StepDecoder:
    """Worker side: the mirror of StepEncoder."""

    def __init__(self) -> None:
        self._tables: dict[int, list[int]] = {}

    def decode(self, message: tuple) -> StepInput:
        _, seqs, swap_in, swap_out, copies = message
        out, tables = [], {}
        for seq_id, token_ids, start_pos, keep, tail, sample in seqs:
            prev = self._tables.get(seq_id, [])
            if keep > len(prev):
                raise ValueError(f"seq {seq_id}: block-table delta keeps {keep} of {len(prev)} entries")
            table = prev[:keep] + tail if keep else tail
            tables[seq_id] = table
            req = None if sample is None else SampleRequest(*sample)
            out.append(SeqInput(seq_id, token_ids, start_pos, table, req))
        self._tables = tables
        return StepInput(out, swap_in, swap_out, copies)


def _common_prefix(prev: list[int], table: list[int]) -> int:
    n = len(prev)
    if n <= len(table) and table[:n] == prev:
        return n  # the usual case: unchanged or grown by a block
    k, limit = 0, min(n, len(table))
    while k < limit and prev[k] == table[k]:
        k += 1
    return k


def encode_output(out: StepOutput) -> dict:
    return {i: (r.token_ids, r.logprobs, r.top_logprobs, r.candidates) for i, r in out.results.items()}


def decode_output(results: dict) -> StepOutput:
    return StepOutput({i: SampleResult(*r) for i, r in results.items()})
