"""Where workers live. The engine only sees this interface, and ``create_executor`` is the
one place that names the implementations (imported there, so this module imports none)."""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, Protocol

from streamkv.config import EngineConfig
from streamkv.messages import StepInput, StepOutput
from streamkv.model_info import ModelInfo

if TYPE_CHECKING:
    from streamkv.layers.token_mask import TokenMask


class StepHandle(Protocol):
    """A step handed to an executor (``Executor.submit``)."""

    __slots__ = ()

    # Whether the step's token masks may follow it (``attach_masks``): only then does the
    # engine overlap a step that samples a structured row (engine/step_pipeline.py). The
    # in-process executor's handles take them (worker/worker.py's LaunchedStep).
    accepts_masks: ClassVar[bool] = False

    def result(self) -> StepOutput: ...

    def attach_masks(self, masks: Mapping[int, TokenMask]) -> None:
        """The token masks of the rows sent with MASK_FOLLOWS, by sequence id; only on a
        handle that ``accepts_masks``."""
        raise NotImplementedError(f"{type(self).__name__} takes no token masks after the step")


class DoneStep(StepHandle):
    """The handle of a step that already ran."""

    __slots__ = ("output",)

    def __init__(self, output: StepOutput) -> None:
        self.output = output

    def result(self) -> StepOutput:
        return self.output


class Executor(abc.ABC):
    """What the engine reads from an executor: the KV pool's size, then one StepOutput per
    StepInput. The model's facts come from the ModelInfo the engine resolved and handed in."""

    @abc.abstractmethod
    def num_available_blocks(self) -> tuple[int, int]: ...

    @abc.abstractmethod
    def init_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None: ...

    # Whether the workers fill a PENDING_TOKEN input from the previous step's samples on the
    # device (async scheduling); the engine sends none to an executor that does not.
    resolves_pending_tokens: ClassVar[bool] = False

    @abc.abstractmethod
    def execute(self, step: StepInput) -> StepOutput: ...

    def submit(self, step: StepInput) -> StepHandle:
        """Hand a step over and return at once if the executor can; ``result()`` of the
        handle returns (or raises) what ``execute`` would. Steps run in submission order.
        The default runs the step here, synchronously."""
        return DoneStep(self.execute(step))

    def check_workers(self) -> None:  # noqa: B027 - nothing to check without worker processes
        """Raise WorkerError if a worker process died or froze while no step was waiting on
        it (the idle engine thread asks, so /health turns at once)."""

    def shutdown(self) -> None:  # noqa: B027 - executors without resources need nothing
        """Release workers and their memory."""


def create_executor(config: EngineConfig, model_info: ModelInfo) -> Executor:
    """The executor ``config.model.executor_backend`` names: "inprocess" or "mp"."""
    if config.model.executor_backend == "mp":
        from streamkv.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, model_info=model_info)
    from streamkv.executor.inprocess import InProcessExecutor

    return InProcessExecutor(config, model_info)
