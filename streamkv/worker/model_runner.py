"""Runs one step: its tensors (input ids, positions, slot mapping, block tables; built in
worker/input_batch.py, decodes first), the model, and the sampler. On CUDA, a decode-only
step replays a captured graph instead (worker/cuda_graphs.py).

``launch`` never waits for the device (async scheduling): it returns a StepResult whose
``result()`` waits for the step's sampled tokens alone. A sequence whose input token is
pending (the step before is sampling it; SeqInput.pending) gets it on the device, gathered
from that step's sampled-token tensor into the input ids before the forward pass, so the
engine can hand over step N+1 before it has read step N's tokens. A structured row of such a
step may come without its token mask (MASK_FOLLOWS: the mask depends on that pending token):
``launch`` then runs the forward pass and the logits, and the sampler runs when the engine
attaches the masks (``StepResult.attach_masks``), before it hands over the next step."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

from streamkv.layers.attention import AttentionMetadata
from streamkv.layers.sample_request import SamplingRows
from streamkv.layers.sampled_batch import SampledBatch, on_device
from streamkv.layers.sampler import Sampler
from streamkv.layers.token_mask import TokenMask
from streamkv.messages import MASK_FOLLOWS, StepOutput
from streamkv.worker.cuda_graphs import DecodeGraphs, capture_sizes
from streamkv.worker.input_batch import ProtocolError, SeqInput, prepare_step
from streamkv.worker.piecewise_graphs import PiecewiseGraphs, token_buckets
from streamkv.worker.prompt_logprobs import score_prompts
from streamkv.worker.sampling_table import PLAIN, SamplingTable


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        block_size: int,
        device: torch.device,
        seed: int = 0,
        samples: bool = True,
        share_tokens=None,
        sampling: SamplingTable | None = None,
    ) -> None:
        self.model = model
        # The InputBatch's sampling parameters, which its SeqInputs' ``slot`` index.
        self.sampling = sampling
        # TP > 1: rank 0's pending tokens to the others (worker/token_broadcast.py)
        self.share_tokens = share_tokens
        self.block_size = block_size
        self.device = device
        self.samples = samples  # False on tensor-parallel ranks other than 0
        self.sampler = Sampler(seed, device)
        self.graphs: DecodeGraphs | None = None  # None: every step runs eagerly
        self.mixed_graphs: PiecewiseGraphs | None = None  # steps with prompt tokens
        # The last step's sampled tokens on the device and each single-sample sequence's
        # row in them: where the next step's pending input tokens come from.
        self._last_tokens: torch.Tensor | None = None
        self._last_batch: SampledBatch | None = None  # finalized before its tokens are read
        self._last_rows: dict[int, int] = {}
        self._awaiting: StepResult | None = None  # a launched step whose token masks follow

    def capture_decode_graphs(self, kv_caches, max_model_len: int, max_num_seqs: int) -> None:
        """Capture the decode-only forward pass for every padded batch size up to
        ``max_num_seqs`` (capped), over these KV pools and contexts up to ``max_model_len``."""
        sizes = capture_sizes(max_num_seqs)
        graphs = DecodeGraphs(
            self.model, kv_caches, self.block_size, max_model_len, sizes, self.device
        )
        graphs.capture()
        self.graphs = graphs

    def capture_mixed_graphs(self, kv_caches, max_num_batched_tokens: int) -> None:
        """Capture the piecewise graphs of steps with prompt tokens, for token counts up to
        the step budget (worker/piecewise_graphs.py)."""
        graphs = PiecewiseGraphs(
            self.model, kv_caches, token_buckets(max_num_batched_tokens), self.device
        )
        graphs.capture()
        self.mixed_graphs = graphs

    def prepare(
        self, seqs: list[SeqInput]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[SeqInput]]:
        """Input ids, positions, attention metadata and the rows' order, decodes first
        (worker/input_batch.py)."""
        return prepare_step(seqs, self.block_size, self.device)

    def _pending_gather(self, rows: list[SeqInput]):
        """A function that writes the pending input tokens of ``rows`` (row i = input id i)
        into an input-ids tensor on the device, and counts them for penalties; None when
        no row is pending."""
        if not self.samples and self.share_tokens is not None:  # no samples here: rank 0 sends them
            pend = [i for i, s in enumerate(rows) if s.pending]
            if not pend:
                return None
            at, got = on_device(self.device, pend), self.share_tokens(None, len(pend))
            return lambda input_ids: input_ids.index_copy_(0, at, got)
        dst, src, slots = [], [], []
        for i, s in enumerate(rows):
            if s.pending:
                j = self._last_rows.get(s.seq_id)
                if j is None:
                    raise ProtocolError(
                        f"sequence {s.seq_id}'s input token is pending, but the last step "
                        "sampled no single token for it"
                    )
                dst.append(i)
                src.append(j)
                slots.append(s.slot if s.sample and s.slot >= 0 else PLAIN)
        if not dst:
            return None
        if self._last_batch is not None:
            self._last_batch.finalize()  # top-p's later rounds, if any: the tokens are then final
        # Penalties: the pending tokens of the rows with a token-count row are counted too.
        counts = self.sampling.counts if self.sampling is not None else None
        count_rows, count_src = [], []
        if counts is not None:
            crows = self.sampling.counts_rows(slots)
            has = np.flatnonzero(crows >= 0)
            if len(has):
                count_rows, count_src = crows[has].tolist(), [src[k] for k in has.tolist()]
            else:
                counts = None
        last = self._last_tokens
        d, g = on_device(self.device, dst + count_rows), on_device(self.device, src + count_src)
        n = len(dst)
        picked = last[g[:n]]
        if self.share_tokens is not None:
            self.share_tokens(picked, n)

        def fill(input_ids: torch.Tensor) -> None:
            input_ids[d[:n]] = picked
            if counts is not None:
                tokens = last[g[n:]]
                counts.output.index_put_(
                    (d[n:], tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True
                )

        return fill

    @torch.inference_mode()
    def forward(
        self, seqs: list[SeqInput], kv_caches, use_graphs: bool = True
    ) -> tuple[torch.Tensor, list[SeqInput]]:
        """Hidden states of every computed token, and the order of their rows. A graph
        replay's rows past ``len(seqs)`` are padding."""
        if use_graphs and self.graphs is not None and self.graphs.can_run(seqs, kv_caches):
            return self.graphs.run(seqs, self._pending_gather(seqs)), list(seqs)
        input_ids, positions, meta, ordered = self.prepare(seqs)
        fill = self._pending_gather(ordered)  # decodes, the only pending rows, come first
        if fill is not None:
            fill(input_ids)
        mixed = self.mixed_graphs
        if use_graphs and mixed is not None and mixed.can_run(input_ids.shape[0], kv_caches):
            return mixed.run(input_ids, positions, meta), ordered
        return self.model(input_ids, positions, kv_caches, meta), ordered

    def execute(self, seqs: list[SeqInput], kv_caches, use_graphs: bool = True) -> StepOutput:
        return self.launch(seqs, kv_caches, use_graphs).result()

    @torch.inference_mode()
    def launch(self, seqs: list[SeqInput], kv_caches, use_graphs: bool = True) -> StepResult:
        """Run the step without waiting for the device; ``result()`` of the return waits."""
        if self._awaiting is not None:
            raise ProtocolError(
                "a step was launched before the token masks of the step before it were attached"
            )
        try:
            hidden, ordered = self.forward(seqs, kv_caches, use_graphs) if seqs else (None, [])
        finally:
            # Pending tokens come from the step just before: never from an older one.
            self._last_tokens, self._last_rows, self._last_batch = None, {}, None
        if not seqs:
            return StepResult([], None)
        scored = {}  # prompt logprobs: every prompt row of the sequences that asked
        if any(s.scoring is not None for s in ordered):
            scored = score_prompts(self.model, hidden, ordered, self.samples)
        # Only the last row of each sampling sequence needs logits.
        rows, slots, ids, masks = [], [], [], None
        end = 0
        for s in ordered:
            end += len(s.token_ids)
            if s.sample:
                rows.append(end - 1)
                slots.append(s.slot)
                ids.append(s.seq_id)
                if s.token_mask is not None:
                    masks = masks or {}
                    masks[len(ids) - 1] = s.token_mask
        if not rows:
            return StepResult([], None, scored)
        if rows[-1] == len(rows) - 1:  # rows ascend, so these are rows 0..k-1: no gather
            hidden = hidden[: len(rows)]
        else:
            hidden = hidden[on_device(self.device, rows)]
        if not self.samples:
            # A sharded (untied) lm_head all-gathers its logits: this rank must take part.
            if self.model.lm_head is not None and self.model.tp_size > 1:
                self.model.compute_logits(hidden)
            return StepResult([], None)
        logits = self.model.compute_logits(hidden)
        sampled = self._rows(ordered, slots, masks)
        if masks is not None and any(m == MASK_FOLLOWS for m in masks.values()):
            self._awaiting = StepResult(
                ids, None, scored, sample=lambda late: self._sample(logits, sampled, ids, late)
            )
            return self._awaiting
        return StepResult(ids, self._sample(logits, sampled, ids), scored)

    def _rows(
        self, ordered: list[SeqInput], slots: list[int], masks: dict[int, TokenMask] | None
    ) -> SamplingRows:
        """The step's sampled rows' parameters: gathered from the InputBatch's table, or
        the hand-made inputs' SampleRequests (tests, benchmarks)."""
        if slots[0] >= 0:
            token_masks = None
            if masks is not None:
                token_masks = [None] * len(slots)
                for k, m in masks.items():
                    token_masks[k] = m
            return self.sampling.take(slots, token_masks)
        return SamplingRows.of([s.sample for s in ordered if s.sample])

    def _sample(
        self,
        logits: torch.Tensor,
        rows: SamplingRows,
        ids: list[int],
        late: Mapping[int, TokenMask] | None = None,
    ) -> SampledBatch:
        """Sample the step; ``late``: the token masks that followed it, by sequence id (a
        row sent with MASK_FOLLOWS and missing here samples unconstrained: it has ended)."""
        if late is not None:
            self._awaiting = None
            masks = rows.token_masks
            for k, seq_id in enumerate(ids):
                if masks[k] == MASK_FOLLOWS:
                    masks[k] = late.get(seq_id)
        batch = self.sampler(logits, rows)
        num_samples = rows.num_samples
        if (num_samples == 1).all():
            last_rows = dict(zip(ids, range(len(ids))))
        else:
            last_rows, k = {}, 0
            for seq_id, n in zip(ids, num_samples.tolist()):
                if n == 1:
                    last_rows[seq_id] = k
                k += n
        self._last_tokens, self._last_rows, self._last_batch = batch.tokens, last_rows, batch
        return batch


class StepResult:
    """A launched step's samples: ``result()`` waits for them (and only for them). A step
    whose token masks follow is sampled by ``attach_masks``, which must come first."""

    __slots__ = ("_ids", "_batch", "_prompt_logprobs", "_sample")

    def __init__(
        self,
        seq_ids: list[int],
        batch: SampledBatch | None,
        prompt_logprobs: dict | None = None,
        sample: Callable[[Mapping[int, TokenMask]], SampledBatch] | None = None,
    ) -> None:
        self._ids, self._batch = seq_ids, batch
        self._prompt_logprobs = prompt_logprobs
        self._sample = sample  # the step's sampler, waiting for its masks

    @torch.inference_mode()  # the logits were made in the step's inference mode
    def attach_masks(self, masks: Mapping[int, TokenMask]) -> None:
        """The token masks of the rows sent with MASK_FOLLOWS, by sequence id (words as in
        SeqStep.token_mask: bytes, or an int32 array); launches the step's sampler."""
        if self._sample is None:
            raise ProtocolError("token masks attached to a step that was not waiting for them")
        sample, self._sample = self._sample, None
        self._batch = sample(masks)

    def result(self) -> StepOutput:
        if self._sample is not None:
            raise ProtocolError("a step's result was read before its token masks were attached")
        out = StepOutput()
        if self._batch is not None:
            out.results = dict(zip(self._ids, self._batch.results()))
        if self._prompt_logprobs:
            out.prompt_logprobs = self._prompt_logprobs
        return out
