"""Which executor an engine gets: the one place that names the implementations, so that
``base.py`` (the interface they implement) imports none of them."""

from __future__ import annotations

from streamkv.config import EngineConfig
from streamkv.executor.base import Executor
from streamkv.model_info import ModelInfo


def create_executor(config: EngineConfig, model_info: ModelInfo) -> Executor:
    """The executor ``config.model.executor_backend`` names: "inprocess" or "mp"."""
    if config.model.executor_backend == "mp":
        from streamkv.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, model_info=model_info)
    from streamkv.executor.inprocess import InProcessExecutor

    return InProcessExecutor(config, model_info)
