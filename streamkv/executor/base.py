"""Where workers live. The engine only sees this interface."""

from __future__ import annotations

import abc
import time
from typing import ClassVar, Protocol

from streamkv.messages import StepInput, StepOutput


class StepHandle(Protocol):
    def result(self) -> StepOutput: ...


class DoneStep:
    """The handle of a step that already ran, in ``seconds``."""

    __slots__ = ("output", "seconds")

    def __init__(self, output: StepOutput, seconds: float) -> None:
        self.output, self.seconds = output, seconds

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
        start = time.perf_counter()
        output = self.execute(step)
        return DoneStep(output, time.perf_counter() - start)

    def check_workers(self) -> None:  # noqa: B027 - nothing to check without worker processes
        """Raise WorkerError if a worker process died or froze while no step was waiting on
        it (the idle engine thread asks, so /health turns at once)."""

    def shutdown(self) -> None:  # noqa: B027 - executors without resources need nothing
        """Release workers and their memory."""
