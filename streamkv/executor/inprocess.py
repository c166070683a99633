"""Tensor-parallel size 1: the worker lives in this process (the async engine calls
``execute`` from a background thread, so the event loop never runs model code). ``submit``
returns once the step is launched on the device: on a GPU the engine's host work for the
next step overlaps this one (async scheduling); on a CPU the step runs inside ``submit``."""

from __future__ import annotations

from streamkv.config import EngineConfig
from streamkv.executor.base import Executor, StepHandle
from streamkv.messages import StepInput, StepOutput
from streamkv.model_info import ModelInfo
from streamkv.worker.worker import Worker


class InProcessExecutor(Executor):
    resolves_pending_tokens = True

    def __init__(self, config: EngineConfig, model_info: ModelInfo | None = None) -> None:
        self.worker = Worker(config, model_info=model_info)

    def num_available_blocks(self) -> tuple[int, int]:
        return self.worker.num_available_blocks()

    def init_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        self.worker.init_cache(num_device_blocks, num_cpu_blocks)

    def execute(self, step: StepInput) -> StepOutput:
        return self.worker.execute(step)

    def submit(self, step: StepInput) -> StepHandle:
        return self.worker.launch(step)

    def shutdown(self) -> None:
        self.worker.release()
