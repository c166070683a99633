"""Builds one step's tensors (input ids, positions, slot mapping, block tables), runs the
model and samples. Decode sequences (one new token) go first so they form one batched
paged-decode call; prompt spans follow. On CUDA, a decode-only step replays a captured
graph instead (worker/cuda_graphs.py)."""

from __future__ import annotations

import torch

from streamkv.layers.attention import AttentionMetadata, PrefillSpan
from streamkv.layers.sampler import Sampler
from streamkv.worker.cuda_graphs import DecodeGraphs, capture_sizes
from streamkv.worker.messages import SeqInput, StepOutput


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, block_size: int, device: torch.device, seed: int = 0, samples: bool = True
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.samples = samples  # False on tensor-parallel ranks other than 0
        self.sampler = Sampler(seed, device)
        self.graphs: DecodeGraphs | None = None  # None: every step runs eagerly

    def capture_decode_graphs(self, kv_caches, max_model_len: int, max_num_seqs: int) -> None:
        """Capture the decode-only forward pass for every padded batch size up to
        ``max_num_seqs`` (capped), over these KV pools and contexts up to ``max_model_len``."""
        sizes = capture_sizes(max_num_seqs)
        graphs = DecodeGraphs(self.model, kv_caches, self.block_size, max_model_len, sizes, self.device)
        graphs.capture()
        self.graphs = graphs

    def _slots(self, s: SeqInput) -> list[int]:
        bs, table = self.block_size, s.block_table
        return [table[p // bs] * bs + p % bs for p in range(s.start_pos, s.start_pos + len(s.token_ids))]

    def prepare(self, seqs: list[SeqInput]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[SeqInput]]:
        decodes = [s for s in seqs if len(s.token_ids) == 1]
        prefills = [s for s in seqs if len(s.token_ids) > 1]
        ordered = decodes + prefills
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for s in ordered:
            ids.extend(s.token_ids)
            pos.extend(range(s.start_pos, s.start_pos + len(s.token_ids)))
            slots.extend(self._slots(s))
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev))
        if decodes:
            width = max(len(s.block_table) for s in decodes)
            tables = [s.block_table + [0] * (width - len(s.block_table)) for s in decodes]
            lens = [s.start_pos + 1 for s in decodes]
            meta.num_decode = len(decodes)
            meta.decode_block_tables = torch.tensor(tables, dtype=torch.int32, device=dev)
            meta.decode_context_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
            meta.decode_max_context_len = max(lens)
        row = len(decodes)
        for s in prefills:
            n = len(s.token_ids)
            meta.prefills.append(
                PrefillSpan(
                    start=row,
                    end=row + n,
                    block_table=torch.tensor(s.block_table, dtype=torch.int32, device=dev),
                    context_len=s.start_pos + n,
                )
            )
            row += n
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        return input_ids, positions, meta, ordered

    @torch.inference_mode()
    def forward(
        self, seqs: list[SeqInput], kv_caches, use_graphs: bool = True
    ) -> tuple[torch.Tensor, list[SeqInput]]:
        """Hidden states of every computed token, and the order of their rows. A graph
        replay's rows past ``len(seqs)`` are padding."""
        if use_graphs and self.graphs is not None and self.graphs.can_run(seqs, kv_caches):
            return self.graphs.run(seqs), list(seqs)
        input_ids, positions, meta, ordered = self.prepare(seqs)
        return self.model(input_ids, positions, kv_caches, meta), ordered

    @torch.inference_mode()
    def execute(self, seqs: list[SeqInput], kv_caches, use_graphs: bool = True) -> StepOutput:
        out = StepOutput()
        if not seqs:
            return out
        hidden, ordered = self.forward(seqs, kv_caches, use_graphs)
        # Only the last row of each sampling sequence needs logits.
        rows, reqs, ids = [], [], []
        end = 0
        for s in ordered:
            end += len(s.token_ids)
            if s.sample is not None:
                rows.append(end - 1)
                reqs.append(s.sample)
                ids.append(s.seq_id)
        if not rows:
            return out
        if rows[-1] == len(rows) - 1:  # rows ascend, so these are rows 0..k-1: no gather
            hidden = hidden[: len(rows)]
        else:
            hidden = hidden[torch.tensor(rows, device=self.device)]
        if not self.samples:
            # A sharded (untied) lm_head all-gathers its logits: this rank must take part.
            if self.model.lm_head is not None and self.model.tp_size > 1:
                self.model.compute_logits(hidden)
            return out
        logits = self.model.compute_logits(hidden)
        for seq_id, result in zip(ids, self.sampler(logits, reqs)):
            out.results[seq_id] = result
        return out
