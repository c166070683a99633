"""Engine configuration, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass

PREEMPTION_MODES = ("auto", "swap", "recompute")
# How the KV pool is handed out. "paged" is the engine; the orca-* policies and ft-max
# (FasterTransformer-style request-level batching) are the paper's contiguous-reservation
# baselines (core/contiguous.py), for benchmarks only.
KV_ALLOCATIONS = ("paged", "orca-max", "orca-pow2", "orca-oracle", "ft-max")
EXECUTOR_BACKENDS = ("inprocess", "mp")


@dataclass
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from memory (gpu_memory_utilization / CPU RAM)
    swap_space: float = 4.0  # GiB of CPU swap
    num_swap_blocks: int | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_space: float = 2.0  # GiB for the KV pool when the model runs on the CPU
    kv_allocation: str = "paged"  # benchmark baselines: see KV_ALLOCATIONS

    def verify(self) -> None:
        if self.kv_allocation not in KV_ALLOCATIONS:
            raise ValueError(f"kv_allocation must be one of {KV_ALLOCATIONS}, got {self.kv_allocation!r}.")
        if self.kv_allocation != "paged" and self.enable_prefix_caching:
            raise ValueError(f"kv_allocation {self.kv_allocation!r} has no prefix cache: turn prefix "
                             "caching off (enable_prefix_caching=False, --no-enable-prefix-caching).")
        if self.block_size not in (8, 16, 32):
            raise ValueError(f"block_size must be 8, 16 or 32, got {self.block_size}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}.")
        if self.num_swap_blocks is not None and self.num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks must be >= 0, got {self.num_swap_blocks}.")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1].")


# Provisional: the default step token budget of chunked prefill, until a measured sweep on
# the GPU picks one (a bigger budget prefills faster; a smaller one keeps decode steps short).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    # Tokens computed per step (chunked prefill: decodes first, then prompt chunks).
    # None: max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_num_seqs).
    max_num_batched_tokens: int | None = None
    preemption_mode: str = "auto"
    max_model_len: int = 2048

    def verify(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}."
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            # Every running sequence must be able to decode in one step: a group's sequences
            # are scheduled together, and a group may hold max_num_seqs of them.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs})."
            )

    @property
    def token_budget(self) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs)


@dataclass
class ModelConfig:
    model: str | None = None  # None = the embedded default
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    # None: "inprocess" for tensor_parallel_size 1, "mp" (one process per rank) above it.
    distributed_executor_backend: str | None = None
    # False: on CUDA, decode-only steps replay CUDA graphs captured at start-up
    # (worker/cuda_graphs.py); True: every step runs eagerly. CPU runs always run eagerly.
    enforce_eager: bool = False

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "inprocess" if self.tensor_parallel_size == 1 else "mp"

    def verify(self) -> None:
        if self.dtype not in ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32"):
            raise ValueError(f"dtype {self.dtype!r} is not supported.")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}.")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(f"load_format {self.load_format!r} is not supported.")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {self.enforce_eager!r}.")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}.")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, got {backend!r}.")
        if tp > 1 and self.executor_backend != "mp":
            raise ValueError(
                f"tensor_parallel_size {tp} needs one process per rank: use "
                "distributed_executor_backend='mp' (the default when tensor_parallel_size > 1)."
            )
        if tp > 1 and self.device.startswith("cuda:"):
            raise ValueError(
                f"device={self.device!r} names one GPU, but tensor_parallel_size {tp} puts rank r "
                "on cuda:r: use device='cuda' (pick GPUs with CUDA_VISIBLE_DEVICES)."
            )


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig

    def verify(self) -> None:
        self.model.verify()
        self.cache.verify()
        self.scheduler.verify()
