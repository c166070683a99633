"""CUDA graphs for decode-only steps (vLLM's "cudagraph" mode).

A decode step of a large model on a fast GPU is bound by the CPU: every layer launches a
dozen kernels from Python, tens of microseconds each, while the GPU work per launch is
short. So the forward pass of a step in which every sequence computes exactly one token is
captured once per padded batch size and replayed:

- Inputs live in static device buffers sized for the largest graph. Each step copies its
  token ids, positions, slots, context lengths and block tables into them (from pinned host
  buffers) and replays the graph of the smallest captured batch that holds it. Padding rows
  get slot -1 (reshape-and-cache skips it) and context length 0 (the decode kernel writes
  zeros for them); their hidden states are never sampled.
- Block tables are padded to the width of a ``max_model_len`` sequence. The decode
  attention kernel's grid (partition size and count) and its partial-result buffers are
  baked into a graph for a context bound, so each batch size is captured once per
  *context bucket* (``context_buckets``: 1024, x4 steps, and ``max_model_len``), and a
  step replays the graph of the smallest bucket that holds its longest context. One graph
  for ``max_model_len`` made a batch of 256 short contexts launch 8x the CTAs it needed
  and merge partitions it never split (docs/kernels.md has the figures). Partitions past a
  sequence's own context exit at once.
- The graphs share one memory pool; they are captured largest batch and bucket first at
  ``init_cache`` time, after a warm-up run of each that compiles and loads every kernel
  and caches its launch attributes, so nothing is loaded or synchronised during capture.
- Steps with prompt tokens, batches larger than the largest graph, and steps whose KV pools
  are not the captured ones run eagerly. Sampling always runs eagerly, after the graph.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from streamkv.layers.attention import AttentionMetadata
from streamkv.worker.capture_guard import collector_paused
from streamkv.worker.input_batch import SeqInput

logger = logging.getLogger(__name__)

# Every batch up to the GPU default max_num_seqs is captured: eager steps are launch-bound
# (2.5x slower at batch 128), and past 256 the ladder thins (steps of 16, then 32), where
# padding a row costs little against a step that long. Each size costs capture time and
# graph memory, logged at start-up.
MAX_CAPTURE_BATCH = 1024
_LADDER = [1, 2, 4, *range(8, 257, 8), *range(272, 513, 16), *range(544, MAX_CAPTURE_BATCH + 1, 32)]
# The first context bucket: the decode kernel's longest partition, so at large batches
# every context up to it runs unsplit, as an eager step would. Buckets then grow 4x: a
# context in a bucket up to 4x its length wastes only idle CTAs and a short merge, while
# each bucket costs one graph per batch size in capture time and memory.
FIRST_CONTEXT_BUCKET = 1024
CONTEXT_BUCKET_GROWTH = 4


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, every multiple of 8 to 256, of 16 to 512, of 32
    beyond, up to the largest decode batch the scheduler can form (``max_num_seqs``, capped
    at ``MAX_CAPTURE_BATCH``), which is itself always captured."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    cap = min(max_num_seqs, MAX_CAPTURE_BATCH)
    return [b for b in _LADDER if b < cap] + [cap]


def context_buckets(max_model_len: int) -> list[int]:
    """Context bounds to capture each batch size for: FIRST_CONTEXT_BUCKET, growing by
    CONTEXT_BUCKET_GROWTH, and ``max_model_len`` itself (always the last)."""
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    buckets, c = [], FIRST_CONTEXT_BUCKET
    while c < max_model_len:
        buckets.append(c)
        c *= CONTEXT_BUCKET_GROWTH
    return [*buckets, max_model_len]


def context_bucket(longest: int, buckets: Sequence[int]) -> int | None:
    """The smallest of the (sorted) ``buckets`` that holds a ``longest``-token context, or None."""
    i = bisect_left(buckets, longest)
    return buckets[i] if i < len(buckets) else None


def padded_batch_size(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest of the (sorted) captured ``sizes`` that holds ``n`` sequences, or None."""
    i = bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def is_decode_only(seqs: Sequence[SeqInput]) -> bool:
    return bool(seqs) and all(len(s.token_ids) == 1 for s in seqs)


class StaticInputs:
    """A decode step's model inputs in fixed device buffers, for ``max_batch`` rows and
    block tables ``max_blocks`` wide. ``fill`` writes a step into the first rows through
    host staging buffers (pinned on CUDA) and pads the batch to ``batch`` rows."""

    def __init__(
        self, max_batch: int, max_blocks: int, block_size: int, device: torch.device
    ) -> None:
        self.block_size, self.device = block_size, device
        pin = device.type == "cuda"
        # Rows of the int64 buffers: token ids, positions, slots. Padding slots stay -1 and
        # padding context lengths 0 until a step's real rows overwrite them.
        self._host_i64 = torch.zeros((3, max_batch), dtype=torch.int64, pin_memory=pin)
        self._host_i64[2] = -1
        self._host_ctx = torch.zeros(max_batch, dtype=torch.int32, pin_memory=pin)
        self._host_tables = torch.zeros((max_batch, max_blocks), dtype=torch.int32, pin_memory=pin)
        self._np_i64, self._np_ctx = self._host_i64.numpy(), self._host_ctx.numpy()
        self._np_tables = self._host_tables.numpy()
        self._dev_i64 = self._host_i64.to(device, copy=True)
        self.context_lens = self._host_ctx.to(device, copy=True)
        self.block_tables = self._host_tables.to(device, copy=True)
        self.input_ids, self.positions, self.slot_mapping = self._dev_i64.unbind(0)
        # The host buffers are copied asynchronously; the next step waits for the copy
        # before it rewrites them (a rank that does not sample never synchronises otherwise).
        self._copied = torch.cuda.Event() if pin else None

    def metadata(self, batch: int, max_context_len: int) -> AttentionMetadata:
        """Attention metadata over the first ``batch`` rows."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            num_decode=batch,
            decode_block_tables=self.block_tables[:batch],
            decode_context_lens=self.context_lens[:batch],
            decode_max_context_len=max_context_len,
        )

    def fill(self, seqs: Sequence[SeqInput], batch: int) -> None:
        n, bs = len(seqs), self.block_size
        pos = [s.start_pos for s in seqs]
        if self._copied is not None:
            self._copied.synchronize()
        h = self._np_i64
        h[0, :n] = [s.token_ids[0] for s in seqs]
        h[1, :n] = pos
        h[2, :n] = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, pos)]
        h[:2, n:batch] = 0
        h[2, n:batch] = -1
        self._np_ctx[:n] = [p + 1 for p in pos]
        self._np_ctx[n:batch] = 0
        # Entries past a sequence's own blocks are stale but never read: attention reads
        # only the blocks that its context length covers.
        tables = self._np_tables
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = s.block_table
        self._dev_i64.copy_(self._host_i64, non_blocking=True)
        self.context_lens[:batch].copy_(self._host_ctx[:batch], non_blocking=True)
        self.block_tables[:n].copy_(self._host_tables[:n], non_blocking=True)
        if self._copied is not None:
            self._copied.record()


class DecodeGraphs:
    """The captured decode graphs of one model and one set of KV pools, one per (batch size,
    context bucket), with their static inputs. ``replays`` counts the steps that ran as a
    graph. ``buckets`` (default ``context_buckets(max_model_len)``) must end at
    ``max_model_len``, so that every servable context has a graph."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        max_model_len: int,
        sizes: Sequence[int],
        device: torch.device,
        buckets: Sequence[int] | None = None,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model, self.kv_caches = model, kv_caches
        self.max_model_len = max_model_len
        self.buckets = sorted(set(context_buckets(max_model_len) if buckets is None else buckets))
        if self.buckets[-1] != max_model_len or self.buckets[0] < 1:
            raise ValueError(
                f"context buckets {self.buckets} must be positive and end at {max_model_len}"
            )
        self.sizes = sorted(set(sizes))
        self.max_batch = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        self.inputs = StaticInputs(self.max_batch, self.max_blocks, block_size, device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0
        self.bucket_replays: Counter[int] = Counter()  # replays per context bucket
        self.capture_seconds = 0.0
        self.memory_bytes = 0  # device memory the capture took (pool and graphs)

    @property
    def count(self) -> int:
        return len(self._graphs)

    def bucket_for(self, seqs: Sequence[SeqInput]) -> int:
        """The smallest context bucket that holds every sequence's context after this step."""
        longest = max(s.start_pos for s in seqs) + 1
        bucket = context_bucket(longest, self.buckets)
        if bucket is None:
            raise ValueError(f"a context of {longest} exceeds max_model_len {self.max_model_len}")
        return bucket

    def model_args(self, batch: int, bucket: int | None = None) -> tuple:
        """The captured model call of ``batch`` rows for contexts up to ``bucket`` (default
        max_model_len): the bound, not the batch's own maximum, sizes the decode grid."""
        i = self.inputs
        meta = i.metadata(batch, self.max_model_len if bucket is None else bucket)
        return i.input_ids[:batch], i.positions[:batch], self.kv_caches, meta

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        # Cached but unused blocks are returned to the driver on both sides of the count:
        # torch.cuda.graph empties the cache when a capture starts, which made the figure
        # negative when taken against a full cache. The graphs' private pool stays held.
        # The capture stream, the graphs and their pool belong to the current device.
        with torch.cuda.device(self.device):
            torch.cuda.empty_cache()
            free_before = torch.cuda.mem_get_info(self.device)[0]
            pool = torch.cuda.graph_pool_handle()
            # Largest first: the smaller ones fit in its memory.
            with collector_paused():
                for b in reversed(self.sizes):
                    for c in reversed(self.buckets):
                        args = self.model_args(b, c)
                        # Warm-up (every slot is padding, so the KV pools are untouched): compiles
                        # and loads the kernels and caches occupancy and shared-memory attributes,
                        # none of which may happen while capturing.
                        self.model(*args)
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=pool):
                            out = self.model(*args)
                        self._graphs[(b, c)] = (graph, out)
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            self.memory_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]
        self.capture_seconds = time.perf_counter() - start
        logger.info(
            "captured %d decode CUDA graphs (batch %d..%d, context buckets %s) in %.1fs, %.0f MiB",
            self.count,
            self.sizes[0],
            self.max_batch,
            self.buckets,
            self.capture_seconds,
            self.memory_bytes / 2**20,
        )

    def can_run(self, seqs: Sequence[SeqInput], kv_caches) -> bool:
        return (
            kv_caches is self.kv_caches
            and 0 < len(seqs) <= self.max_batch
            and is_decode_only(seqs)
            and all(
                s.start_pos < self.max_model_len and len(s.block_table) <= self.max_blocks
                for s in seqs
            )
        )

    def run(
        self, seqs: Sequence[SeqInput], fill_pending: Callable[[torch.Tensor], None] | None = None
    ) -> torch.Tensor:
        """Replays the step (``can_run`` must hold); returns the hidden states of the padded
        batch, row i for ``seqs[i]``. The tensor is the graph's output buffer: the next replay
        overwrites it. ``fill_pending`` writes the pending input tokens into the static
        input ids on the device, after the step's host inputs are copied in and before the
        replay reads them (stream order; async scheduling)."""
        n = len(seqs)
        b = padded_batch_size(n, self.sizes)
        if b is None:
            raise ValueError(f"{n} sequences exceed the largest decode graph ({self.max_batch})")
        bucket = self.bucket_for(seqs)
        graph, out = self._graphs[(b, bucket)]
        with torch.cuda.device(self.device):
            self.inputs.fill(seqs, b)
            if fill_pending is not None:
                fill_pending(self.inputs.input_ids)
            graph.replay()
        self.replays += 1
        self.bucket_replays[bucket] += 1
        return out
