"""Engine configuration, validated once at construction and never changed after.

Each field's metadata is the one source of the engine's arguments (entrypoints/args.py):
the ``streamkv serve`` / ``generate`` flags and ``LLM(**kwargs)`` are derived from the field
names, defaults and ``help``; ``choices`` and ``flag`` (extra spellings) shape the flag, and
``cli=False`` keeps a field off the command line.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

PREEMPTION_MODES = ("auto", "swap", "recompute")
# How the KV pool is handed out. "paged" is the engine; the orca-* policies and ft-max
# (FasterTransformer-style request-level batching) are the paper's contiguous-reservation
# baselines (streamkv/baselines/), for benchmarks only.
KV_ALLOCATIONS = ("paged", "orca-max", "orca-pow2", "orca-oracle", "ft-max")
EXECUTOR_BACKENDS = ("inprocess", "mp")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32")
# Every power of two from 1 to 256 (the paper's Fig 18b sweep; docs/kernels.md "Block sizes").
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# vLLM's names: "auto" stores K/V in the model's dtype; "fp8" and "fp8_e4m3" (the same) store
# float8_e4m3fn, half the bytes, so twice the blocks (docs/kernels.md, "FP8 KV cache").
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# vLLM's name: "fp8" stores the decoder layers' weights as e4m3 with per-channel scales,
# quantized at load time (docs/kernels.md, "FP8 weights"); None keeps the model's dtype.
QUANTIZATIONS = ("fp8",)
DEFAULT_GPU_SWAP_SPACE_GIB = 4.0


def arg(default: Any, help: str, **meta: Any) -> Any:
    """A config field that is also an engine argument (see entrypoints/args.py)."""
    return field(default=default, metadata={"help": help, **meta})


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}.")


@dataclass
class CacheConfig:
    block_size: int = arg(16, "tokens per KV block", choices=BLOCK_SIZES)
    kv_cache_dtype: str = arg(
        "auto",
        "KV cache element type: 'auto' (the model's dtype) or 'fp8' / 'fp8_e4m3' "
        "(float8 e4m3, per-layer scales of 1.0, twice the blocks)",
        choices=KV_CACHE_DTYPES,
    )
    num_kv_blocks: int | None = arg(
        None,
        "KV pool size in blocks (default: sized from memory, gpu_memory_utilization on a GPU, "
        "cpu_kv_cache_space on a CPU)",
    )
    # None: 4 GiB on a GPU, none on a CPU, where a CPU "swap" pool would only duplicate the
    # KV pool in the same RAM (swapping exists to leave the GPU's memory).
    swap_space: float | None = arg(
        None, "GiB of CPU swap space (default: 4 on a GPU, 0 when the model runs on the CPU)"
    )
    num_swap_blocks: int | None = arg(
        None, "CPU swap pool size in blocks (default: from swap_space)"
    )
    enable_prefix_caching: bool = arg(True, "reuse the KV blocks of prompt prefixes seen before")
    gpu_memory_utilization: float = arg(0.9, "fraction of GPU memory the engine may use")
    cpu_kv_cache_space: float = arg(2.0, "GiB of KV pool when the model runs on the CPU")
    kv_allocation: str = arg(
        "paged",
        "how the KV pool is handed out: 'paged' (the engine) or a "
        "contiguous baseline of the paper (benchmarks only)",
        choices=KV_ALLOCATIONS,
    )
    # Files of text computed once at start and pinned (core/reserved_prefix.py, paper §4.4).
    reserved_prefix: tuple[str, ...] = arg(
        (),
        "a file whose text is a reserved shared prefix: computed once, pinned, mapped into "
        "every prompt that starts with it (repeatable)",
        repeatable=True,
        metavar="FILE",
    )

    def verify(self) -> None:
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("kv_allocation", self.kv_allocation, KV_ALLOCATIONS)
        if not isinstance(self.reserved_prefix, (tuple, list)) or not all(
            isinstance(p, str) for p in self.reserved_prefix
        ):
            raise ValueError(
                f"reserved_prefix must be a list of file paths, got {self.reserved_prefix!r}."
            )
        if self.kv_allocation != "paged" and self.reserved_prefix:
            raise ValueError(
                f"kv_allocation {self.kv_allocation!r} cannot share a reserved prefix: use 'paged'."
            )
        if self.kv_allocation != "paged" and self.enable_prefix_caching:
            raise ValueError(
                f"kv_allocation {self.kv_allocation!r} has no prefix cache: turn prefix "
                "caching off (enable_prefix_caching=False, --no-enable-prefix-caching)."
            )
        if type(self.block_size) is not int or self.block_size not in BLOCK_SIZES:  # not True, 16.0
            raise ValueError(
                f"block_size must be a power of two from 1 to 256 {BLOCK_SIZES}, "
                f"got {self.block_size!r}."
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}.")
        if self.num_swap_blocks is not None and self.num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks must be >= 0, got {self.num_swap_blocks}.")
        if self.swap_space is not None and self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1].")

    def swap_space_gib(self, device_type: str) -> float:
        """GiB of CPU swap pool for a model on ``device_type`` ("cuda" or "cpu")."""
        if self.swap_space is not None:
            return self.swap_space
        return DEFAULT_GPU_SWAP_SPACE_GIB if device_type == "cuda" else 0.0


# The step token budget of chunked prefill, the one rule that bounds a step (decodes first,
# then prompt chunks oldest first). On a GPU a bigger budget admits a burst sooner and costs
# inter-token latency while prompts flow; the GPU default is the sweep's pick
# (docs/benchmarks.md "Token budget"). On a CPU the step is compute-bound, so a prompt chunk
# stalls decodes for its whole length: the smaller budget keeps streams moving.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_GPU_MAX_NUM_BATCHED_TOKENS = 8192
# Sequences per step. A GPU with room for a large KV cache (70 GiB or more, vLLM's rule too)
# runs up to 1024: past 256 a decode step's GEMMs cost the same per token while the weights
# are read once for four times the tokens, so the offline ShareGPT run gains (docs/benchmarks.md
# "Offline throughput"). The KV cache still bounds what is admitted.
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_LARGE_GPU_MAX_NUM_SEQS = 1024
LARGE_GPU_BYTES = 70 * 2**30


@dataclass
class SchedulerConfig:
    max_num_seqs: int | None = arg(
        None,
        f"most sequences in one step (default {DEFAULT_LARGE_GPU_MAX_NUM_SEQS} on a GPU of "
        f"{LARGE_GPU_BYTES // 2**30} GiB or more, else {DEFAULT_MAX_NUM_SEQS})",
    )
    max_num_batched_tokens: int | None = arg(
        None,
        "tokens computed per step (chunked prefill: decodes first, then prompt chunks); "
        f"default max({DEFAULT_GPU_MAX_NUM_BATCHED_TOKENS} on a GPU, "
        f"{DEFAULT_MAX_NUM_BATCHED_TOKENS} on a CPU, max_num_seqs)",
    )
    preemption_mode: str = arg(
        "auto",
        "how a preempted request gives its blocks back ('auto': the cheaper of swap and "
        "recompute by a measured cost model)",
        choices=PREEMPTION_MODES,
    )
    preemption_cost_profile: str | None = arg(
        None,
        "the measured swap/recompute costs 'auto' uses: a profile of streamkv/core/"
        "preemption_costs.json (default: its default)",
    )
    # On a GPU by default: with one fill thread and the one-kernel mask step the H200 ran
    # json_schema at 0.72x of unconstrained overlapped against 0.57x in turn (batch 64, same
    # call; docs/benchmarks.md "Structured outputs"). Off on a CPU, where async scheduling is
    # off too.
    overlap_structured: bool | None = arg(
        None,
        "with async scheduling, let a step that samples structured-output rows overlap the "
        "next one (the next step's token masks follow its forward; in-process executor only; "
        "default: on a GPU, off on a CPU)",
    )
    async_scheduling: bool | None = arg(
        None,
        "schedule and submit the next step while the device runs this one, and process its outputs "
        "while the next runs (engine/step_pipeline.py; default: on a GPU, off on a CPU)",
    )

    def verify(self) -> None:
        _check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if (
            self.max_num_seqs is not None
            and self.max_num_batched_tokens is not None
            and self.max_num_batched_tokens < self.max_num_seqs
        ):
            # Every running sequence must be able to decode in one step: a group's sequences
            # are scheduled together, and a group may hold max_num_seqs of them.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs})."
            )

    def on_device(self, device_type: str, device_bytes: int = 0) -> SchedulerConfig:
        """This config with the device-dependent defaults filled in for a model on
        ``device_type`` ("cuda" or "cpu") with ``device_bytes`` of memory."""
        gpu = device_type == "cuda"
        overlap = self.async_scheduling
        structured = self.overlap_structured
        seqs = self.max_num_seqs
        if seqs is None:
            large = gpu and device_bytes >= LARGE_GPU_BYTES
            seqs = DEFAULT_LARGE_GPU_MAX_NUM_SEQS if large else DEFAULT_MAX_NUM_SEQS
        budget = self.max_num_batched_tokens
        if budget is None:
            default = DEFAULT_GPU_MAX_NUM_BATCHED_TOKENS if gpu else DEFAULT_MAX_NUM_BATCHED_TOKENS
            budget = max(default, seqs)
        return replace(
            self,
            max_num_seqs=seqs,
            max_num_batched_tokens=budget,
            async_scheduling=gpu if overlap is None else overlap,
            overlap_structured=gpu if structured is None else structured,
        )

    @property
    def token_budget(self) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs or DEFAULT_MAX_NUM_SEQS)


@dataclass
class ModelConfig:
    # The commands take the model as their own --model argument.
    model: str | None = field(default=None, metadata={"cli": False})  # None = the embedded default
    tokenizer: str | None = arg(None, "local tokenizer directory (default: the model's own)")
    dtype: str = arg("auto", "auto, float32, float16 or bfloat16")
    device: str = arg("auto", "auto, cpu or cuda[:N]")
    load_format: str = arg("auto", "where weights come from", choices=LOAD_FORMATS)
    quantization: str | None = arg(
        None,
        "fp8: decoder-layer weights in e4m3 with per-channel scales, quantized at load time "
        "(default: none, the model's dtype)",
        choices=QUANTIZATIONS,
    )
    seed: int = arg(0, "random seed of the weights of load_format=dummy and of unseeded sampling")
    max_model_len: int | None = arg(None, "context length to serve (default: the model's own)")
    tensor_parallel_size: int = arg(
        1, "shard the model over this many worker processes (GPUs on CUDA)", flag=["-tp"]
    )
    # None: "inprocess" for tensor_parallel_size 1, "mp" (one process per rank) above it.
    distributed_executor_backend: str | None = arg(
        None,
        "where the model runs: 'inprocess' (a thread of this process) or 'mp' (one process "
        "per rank); default inprocess at TP 1 (mp for `serve` on a GPU), mp above",
        choices=EXECUTOR_BACKENDS,
    )
    # False: on CUDA, decode-only steps replay CUDA graphs captured at start-up
    # (worker/cuda_graphs.py); True: every step runs eagerly. CPU runs always run eagerly.
    enforce_eager: bool = arg(
        False,
        "never replay CUDA graphs for decode steps (on a GPU they are captured at start-up "
        "by default; CPU runs are always eager)",
    )
    max_logprobs: int = arg(
        20, "most logprobs and prompt_logprobs a request may ask for (-1: no cap)"
    )

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "inprocess" if self.tensor_parallel_size == 1 else "mp"

    def verify(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported.")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}.")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format {self.load_format!r} is not supported.")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be None or one of {QUANTIZATIONS}, got {self.quantization!r}."
            )
        if self.tokenizer is not None and not Path(self.tokenizer).expanduser().is_dir():
            raise ValueError(
                "tokenizer must be a local directory, got "
                f"{self.tokenizer!r} (streamkv never downloads)."
            )
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {self.enforce_eager!r}.")
        if (
            not isinstance(self.max_logprobs, int)
            or isinstance(self.max_logprobs, bool)
            or self.max_logprobs < -1
        ):
            raise ValueError(f"max_logprobs must be an integer >= -1, got {self.max_logprobs!r}.")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}.")
        backend = self.distributed_executor_backend
        if backend is not None:
            _check_choice("distributed_executor_backend", backend, EXECUTOR_BACKENDS)
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
