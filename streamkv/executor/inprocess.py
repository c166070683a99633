"""Tensor-parallel size 1: the worker lives in this process (the async engine calls
``execute`` from a background thread, so the event loop never runs model code)."""

from __future__ import annotations

from streamkv.config import EngineConfig
from streamkv.executor.base import Executor
from streamkv.messages import StepInput, StepOutput
from streamkv.model_info import ModelInfo
from streamkv.worker.worker import Worker


class InProcessExecutor(Executor):
    def __init__(self, config: EngineConfig, model_info: ModelInfo | None = None) -> None:
        self.worker = Worker(config, model_info=model_info)
        self.model_info = self.worker.model_info

    @property
    def model_dir(self):
        return self.model_info.model_dir

    @property
    def hf_config(self) -> dict:
        return self.model_info.hf_config

    @property
    def device(self):
        return self.worker.device

    @property
    def dtype(self):
        return self.worker.dtype

    def num_available_blocks(self) -> tuple[int, int]:
        return self.worker.num_available_blocks()

    def init_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        self.worker.init_cache(num_device_blocks, num_cpu_blocks)

    def execute(self, step: StepInput) -> StepOutput:
        return self.worker.execute(step)
