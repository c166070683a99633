"""Piecewise CUDA graphs for steps that carry prompt tokens (mixed steps).

A mixed step cannot be one graph: its attention depends on how the step's tokens split
into decodes and prompt spans (grid sizes, span tables), which changes every step. The rest
of the forward pass — embedding, norms, projections, rotary, MLP — depends only on the
number of tokens. Run eagerly, that rest is ~10 launches per layer from Python, tens of
microseconds each: on an H200 with llama3-8b a mixed step of a few hundred tokens took
twice the time of a decode step of the same batch, most of it the CPU launching kernels.

So for each bucket of token counts the forward pass is captured as one graph per stretch
between attention calls (layers + 1 graphs), and a step replays them in order with each
layer's attention run eagerly in between (vLLM's "piecewise" mode):

    graph 0: embed, layer 0 up to its q/k/v  ->  attention 0 (eager)
    graph 1: layer 0's o_proj + MLP, layer 1 up to its q/k/v  ->  attention 1 (eager) ...
    graph L: layer L-1's o_proj + MLP, final norm

Capture routes ``PagedAttention`` through ``AttentionMetadata.piecewise``: at each call the
graph being captured copies q/k/v into the bucket's static buffers and ends, and the next
graph starts reading the static attention output. At replay the eager attention reads and
writes those same buffers with the step's real metadata. Rows past the step's tokens are
padding: token id 0, position 0, slot -1 (reshape-and-cache skips it), covered by no decode
row and no span, and never sampled.

Every bucket's graphs share one memory pool: a value lives only within one replay of one
bucket, and buckets never interleave. A bucket keeps only its static q/k/v, attention output
and final hidden states; the pool holds the largest bucket's temporaries.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import replace

import torch

from streamkv.layers.attention import AttentionMetadata, PagedAttention
from streamkv.worker.capture_guard import collector_paused

logger = logging.getLogger(__name__)


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts to capture: 16, 32, 64, then every multiple of 128 up to 2048, then
    steps of a quarter of the last, up to ``max_tokens`` (the step budget), which is itself
    always captured. Fine steps keep the padded GEMM rows close to the real ones: a mixed
    step's GEMMs cost about as much per token as its tokens need."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    ladder, c = [16, 32, 64, *range(128, 2049, 128)], 2048
    while c < max_tokens:
        c += c // 4
        ladder.append(c)
    return [b for b in ladder if b < max_tokens] + [max_tokens]


class _Bucket:
    """The graphs of one token count and the static buffers they and the eager attention
    calls between them share. During capture it is the ``AttentionMetadata.piecewise`` hook."""

    def __init__(self, tokens: int, pool, stream: torch.cuda.Stream) -> None:
        self.tokens, self.pool, self.stream = tokens, pool, stream
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.layers: list[tuple[PagedAttention, tuple[torch.Tensor, torch.Tensor]]] = []
        self.q = self.k = self.v = self.out = self.hidden = None
        self._graph: torch.cuda.CUDAGraph | None = None

    def _begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool)

    def _end(self) -> None:
        self._graph.capture_end()
        self.graphs.append(self._graph)
        self._graph = None

    def attention(self, layer: PagedAttention, q, k, v, kv_cache) -> torch.Tensor:
        """Capture-time stand-in for ``layer``'s attention: ends the current graph with q/k/v
        in the static buffers and starts the next one from the static output."""
        if self.q is None:  # first layer: the buffers come from the pool and stay held
            self.q, self.k, self.v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            self.out = torch.empty_like(q)
        self.q.copy_(q)
        self.k.copy_(k)
        self.v.copy_(v)
        self._end()
        self.layers.append((layer, kv_cache))
        self._begin()
        return self.out

    @torch.inference_mode()
    def capture(self, model: torch.nn.Module, input_ids, positions, kv_caches, slots) -> None:
        meta = AttentionMetadata(slot_mapping=slots)  # every slot padding: nothing is written
        model(input_ids, positions, kv_caches, meta)  # warm-up: kernels compiled and loaded
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self._begin()
            self.hidden = model(input_ids, positions, kv_caches, replace(meta, piecewise=self))
            self._end()
        torch.cuda.current_stream().wait_stream(self.stream)

    def replay(self, meta: AttentionMetadata) -> torch.Tensor:
        for graph, (layer, kv_cache) in zip(self.graphs, self.layers):
            graph.replay()
            layer.attend(self.q, self.k, self.v, kv_cache, meta, out=self.out)
        self.graphs[-1].replay()
        return self.hidden


class PiecewiseGraphs:
    """Mixed-step graphs of one model over one set of KV pools, one ``_Bucket`` per token
    count in ``sizes``. ``replays`` counts the steps that ran this way."""

    def __init__(
        self, model: torch.nn.Module, kv_caches, sizes: Sequence[int], device: torch.device
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.sizes = sorted(set(sizes))
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self._buckets: dict[int, _Bucket] = {}
        self.replays = 0
        self.capture_seconds = 0.0
        self.memory_bytes = 0

    def capture(self) -> None:
        start = time.perf_counter()
        with torch.cuda.device(self.device):
            torch.cuda.empty_cache()
            free_before = torch.cuda.mem_get_info(self.device)[0]
            pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(self.device)
            with collector_paused():
                for t in reversed(self.sizes):  # largest first: the smaller fit in its memory
                    bucket = _Bucket(t, pool, stream)
                    bucket.capture(
                        self.model,
                        self.input_ids[:t],
                        self.positions[:t],
                        self.kv_caches,
                        self.slots[:t],
                    )
                    self._buckets[t] = bucket
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            self.memory_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]
        self.capture_seconds = time.perf_counter() - start
        logger.info(
            "captured piecewise CUDA graphs for %d token "
            "counts (%d..%d, %d graphs each) in %.1fs, %.0f MiB",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            len(next(iter(self._buckets.values())).graphs),
            self.capture_seconds,
            self.memory_bytes / 2**20,
        )

    def can_run(self, num_tokens: int, kv_caches) -> bool:
        return kv_caches is self.kv_caches and 0 < num_tokens <= self.sizes[-1]

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states of the step's ``len(input_ids)`` tokens (``can_run`` must hold). The
        tensor is the bucket's output buffer: the next replay overwrites it."""
        n = input_ids.shape[0]
        t = self.sizes[bisect_left(self.sizes, n)]
        with torch.cuda.device(self.device):
            self.input_ids[:n].copy_(input_ids, non_blocking=True)
            self.positions[:n].copy_(positions, non_blocking=True)
            self.slots[:n].copy_(meta.slot_mapping, non_blocking=True)
            if t > n:
                self.input_ids[n:t].zero_()
                self.positions[n:t].zero_()
                self.slots[n:t].fill_(-1)
            hidden = self._buckets[t].replay(replace(meta, slot_mapping=self.slots[:t]))
        self.replays += 1
        return hidden[:n]
