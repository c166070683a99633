"""One rank: owns a model shard and its KV pools, executes StepInputs. It decides nothing
about memory: swaps, copies and slots all come from the scheduler."""

from __future__ import annotations

import gc
import logging
import os

import torch

from streamkv.config import EngineConfig
from streamkv.messages import StepFailed, StepInput, StepOutput
from streamkv.model_info import ModelInfo
from streamkv.models.loader import resolve_model_info
from streamkv.models.registry import build_model
from streamkv.worker.cache_engine import CacheEngine, kv_bytes_per_block, kv_cache_torch_dtype
from streamkv.worker.input_batch import InputBatch, SeqInput
from streamkv.worker.model_runner import ModelRunner, StepResult
from streamkv.worker.sampling_table import PLAIN
from streamkv.worker.token_broadcast import TokenBroadcast

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(name: str) -> torch.device:
    """The one place a configured device ("auto", "cpu", "cuda[:N]") becomes a device.
    LLMEngine calls it once and hands on a config that names the result, so the executor
    and its workers only parse that name (and check CUDA is there in their own process)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA GPU is available")
    return device


def device_memory(device: torch.device) -> int:
    """Total bytes of ``device`` (0 for a CPU): picks the GPU defaults of SchedulerConfig.
    Reads the device's properties only, so no CUDA context is made in the engine process."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # CPU matmuls in half precision are slow and far from the reference numerics.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class Worker:
    def __init__(
        self, config: EngineConfig, rank: int = 0, model_info: ModelInfo | None = None
    ) -> None:
        self.config = config
        self.rank = rank
        mc = config.model
        self.device = resolve_device(mc.device)  # already resolved, unless built alone (benchmarks)
        if self.device.type == "cuda" and mc.tensor_parallel_size > 1:
            # One GPU per rank, numbered on its own host (ranks on several hosts: LOCAL_RANK,
            # as executor/rank.py sets the device).
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(mc.dtype, self.device)
        self.cache_dtype = kv_cache_torch_dtype(config.cache.kv_cache_dtype, self.dtype)
        # The engine's ModelInfo; resolved here only for a Worker built on its own (benchmarks).
        self.model_info = model_info or resolve_model_info(mc)
        self.model_dir, self.hf_config = self.model_info.model_dir, self.model_info.hf_config
        torch.manual_seed(mc.seed)
        self.model = build_model(
            self.model_dir,
            self.dtype,
            self.device,
            mc.load_format,
            tp_rank=rank,
            tp_size=mc.tensor_parallel_size,
            seed=mc.seed,
            config=self.hf_config,
            quantization=mc.quantization,
        )
        self.cache: CacheEngine | None = None
        # Every rank computes the same logits; only rank 0 samples and answers the engine, and
        # sends the other ranks the pending input tokens a step takes from its samples.
        self.share_tokens = (
            TokenBroadcast(rank, self.device) if mc.tensor_parallel_size > 1 else None
        )
        # Every sequence's sampling state and block table, kept across steps (the engine's
        # StepBuilder sends each only once, then deltas).
        self.input_batch = InputBatch(self.model.shape.vocab_size, self.device, samples=rank == 0)
        self.runner = ModelRunner(
            self.model,
            config.cache.block_size,
            self.device,
            seed=mc.seed,
            samples=rank == 0,
            share_tokens=self.share_tokens,
            sampling=self.input_batch.sampling,
        )
        # The last launch raised (StepFailed): its samples, which the next step may have been
        # planned to take as pending tokens (multiprocess executor), do not exist.
        self._last_failed = False

    def block_bytes(self) -> int:
        s = self.model.shape
        kv_heads = max(1, s.num_kv_heads // self.config.model.tensor_parallel_size)
        return kv_bytes_per_block(
            s.num_layers, kv_heads, s.head_dim, self.config.cache.block_size, self.cache_dtype
        )

    def num_available_blocks(self) -> tuple[int, int]:
        """(device blocks, cpu swap blocks) that fit the configured memory."""
        cc = self.config.cache
        per_block = self.block_bytes()
        if cc.num_kv_blocks is not None:
            device_blocks = cc.num_kv_blocks
        elif self.device.type == "cuda":
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            # Leave room for activations of the largest step (a rough, measured-safe margin).
            budget = free - (1 - cc.gpu_memory_utilization) * total - 2 * 2**30
            device_blocks = max(int(budget // per_block), 0)
        else:
            device_blocks = int(cc.cpu_kv_cache_space * 2**30 // per_block)
        if cc.num_swap_blocks is not None:
            cpu_blocks = cc.num_swap_blocks
        else:
            cpu_blocks = int(cc.swap_space_gib(self.device.type) * 2**30 // per_block)
        # The CPU pool never needs more blocks than the device pool.
        cpu_blocks = min(cpu_blocks, device_blocks)
        params = list(self.model.parameters())
        logger.info(
            "%s on %s: %.1fM parameters, %s, %.2f GiB of weights; %d KV blocks of %d tokens "
            "fit (%s, %.2f GiB, %d tokens), %d CPU swap blocks",
            type(self.model).__name__,
            self.device,
            sum(p.numel() for p in params) / 1e6,
            self.dtype,
            sum(p.numel() * p.element_size() for p in params) / 2**30,
            device_blocks,
            cc.block_size,
            self.cache_dtype,
            device_blocks * per_block / 2**30,
            device_blocks * cc.block_size,
            cpu_blocks,
        )
        return device_blocks, cpu_blocks

    def init_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        s = self.model.shape
        kv_heads = max(1, s.num_kv_heads // self.config.model.tensor_parallel_size)
        self.cache = CacheEngine(
            s.num_layers,
            kv_heads,
            s.head_dim,
            self.config.cache.block_size,
            num_device_blocks,
            num_cpu_blocks,
            self.cache_dtype,
            self.device,
        )
        if self.device.type == "cuda" and not self.config.model.enforce_eager:
            # The graphs' memory pool (decode activations and attention partials, logged at
            # capture) comes out of the activation margin num_available_blocks leaves.
            self.runner.capture_decode_graphs(
                self.cache.device_cache,
                self.model_info.max_model_len,
                self.config.scheduler.max_num_seqs,
            )
            self.runner.capture_mixed_graphs(
                self.cache.device_cache, self.config.scheduler.token_budget
            )

    def execute(self, step: StepInput) -> StepOutput:
        return self.launch(step).result()

    def release(self) -> None:
        """Drop everything this worker holds on the device (weights, KV pools, CUDA graphs and
        their memory pools, step buffers), so that another engine in this process finds the
        memory free. The worker cannot run steps after this."""
        for name in ("runner", "cache", "model", "input_batch", "share_tokens"):
            if hasattr(self, name):
                setattr(self, name, None)
        gc.unfreeze()  # a rank froze its heap after start-up (executor/rank.py): cycles too
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # cuBLAS keeps its own
            if clear is not None:
                clear()
            torch.cuda.empty_cache()

    def launch(self, step: StepInput) -> LaunchedStep:
        """Hand the step to the device without waiting for it; ``result()`` of the return
        waits for its samples. Raises StepFailed if the model or the sampler raised."""
        # The state first and outside the failure path below: a step that does not fit it is
        # an engine bug (ProtocolError), not a failed step.
        seqs = self.input_batch.apply(step)
        last_failed, self._last_failed = self._last_failed, False
        if last_failed and self.rank == 0:
            self._without_samples(seqs)
        # Order matters: blocks swapped out this step may be reused by copies and new slots.
        self.cache.swap_out(step.swap_out)
        self.cache.swap_in(step.swap_in)
        self.cache.copy(step.copies)
        try:
            result = self.runner.launch(seqs, self.cache.device_cache)
        except Exception as e:
            self._last_failed = True
            raise self.step_failed(e) from e
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return LaunchedStep(self, result, done)

    def _without_samples(self, seqs: list[SeqInput]) -> None:
        """The step before failed here, after the engine had sent this one (a step in flight):
        the tokens pending from it were never sampled. Their requests end with that failure
        (the engine fails every request of a failed step and discards this step's output for
        them), so token 0 stands in, sampled plainly: nothing of the request (a seed, a
        penalty, whatever made the step before fail) runs again and fails this step, whose
        other requests must go on. The other ranks get token 0 as they would have the tokens
        (worker/token_broadcast.py), so every rank makes the same collective calls."""
        pending = [s for s in seqs if s.pending]
        for s in pending:
            s.pending, s.token_ids = False, [0]
            s.slot, s.token_mask = PLAIN, None  # the defaults' row of the sampling table
        if pending and self.share_tokens is not None:
            self.share_tokens.send_placeholders(len(pending))

    def step_failed(self, e: Exception) -> StepFailed:
        if self.device.type == "cuda":
            try:  # a kernel fault is sticky: then nothing on this device can go on
                torch.cuda.synchronize(self.device)
            except Exception:
                raise e from None
        return StepFailed(f"{type(e).__name__}: {e}")


class LaunchedStep:
    """A step on its way through the device (Executor.submit's handle for this worker)."""

    __slots__ = ("_worker", "_result", "_done")
    accepts_masks = True  # the StepHandle capability (executor/base.py)

    def __init__(self, worker: Worker, result: StepResult, done: torch.cuda.Event | None) -> None:
        self._worker, self._result, self._done = worker, result, done

    def result(self) -> StepOutput:
        try:
            return self._result.result()
        except Exception as e:
            raise self._worker.step_failed(e) from e

    def attach_masks(self, masks) -> None:
        """Structured outputs: the token masks of the rows sent with MASK_FOLLOWS, by sequence
        id; the step's sampler runs now (ModelRunner: StepResult.attach_masks)."""
        try:
            self._result.attach_masks(masks)
        except Exception as e:
            raise self._worker.step_failed(e) from e

    def ready(self) -> bool:
        """Whether the device is done with the step, so that ``result()`` will not wait for
        it (always, on a CPU, where the step ran inside ``launch``)."""
        return self._done is None or self._done.query()
