"""What travels between the engine and its worker processes, and how.

Every message is a msgspec Struct, encoded as MessagePack and decoded against the closed
union of the messages that side may receive: a peer's bytes can only ever become one of
these typed records (or a DecodeError), never an arbitrary object, so nothing is unpickled.
Each message is a tagged array (its kind, then its fields in order). A step travels as the
StepInput of streamkv/messages.py, which already carries only deltas (new sequences once,
then new tokens and block ids), so this layer keeps no state of its own.
"""

from __future__ import annotations

from typing import Any

import msgspec

from streamkv.messages import StepInput, StepOutput


# -- engine -> worker ----------------------------------------------------------------------
class Setup(msgspec.Struct, tag="setup", array_like=True):
    rank: int
    tp: int
    config: dict[str, Any]  # dataclasses.asdict(EngineConfig): plain values only
    model_info: dict[
        str, Any
    ]  # ModelInfo.to_dict(): the model's facts, resolved once by the engine
    backend: str  # torch.distributed backend: "gloo" or "nccl"
    init_method: str
    log_level: int


class Step(msgspec.Struct, tag="step", array_like=True):
    step: StepInput


class QueryBlocks(msgspec.Struct, tag="blocks?", array_like=True):
    pass


class InitCache(msgspec.Struct, tag="init_cache", array_like=True):
    num_device_blocks: int
    num_cpu_blocks: int


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class Resume(msgspec.Struct, tag="resume", array_like=True):
    """To a rank that answered a step with StepError, once every rank has answered that step:
    it may run the next one. A rank that failed a step waits for this before running any
    later step (already sent, with async scheduling), since a peer may still be inside one
    of the failed step's collectives; then the ranks have diverged and the engine stops them
    instead (executor/multiproc.py)."""


ToWorker = Setup | Step | QueryBlocks | InitCache | Shutdown | Resume


# -- worker -> engine ----------------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready", array_like=True):
    pass


class Blocks(msgspec.Struct, tag="blocks", array_like=True):
    num_device_blocks: int
    num_cpu_blocks: int


class Ok(msgspec.Struct, tag="ok", array_like=True):
    pass


class Out(msgspec.Struct, tag="out", array_like=True):
    output: StepOutput
    worker_s: float  # rank 0's time from the step's launch to its samples (IPC statistics)


class Error(msgspec.Struct, tag="error", array_like=True):
    message: str
    traceback: str


class StepError(msgspec.Struct, tag="step_error", array_like=True):
    """The model or the sampler raised during a step (StepFailed) and the rank serves on: the
    engine fails that step's requests once every rank has answered the step."""

    message: str


FromWorker = Ready | Blocks | Ok | Out | Error | StepError


# -- a rank on another host joining the engine (executor/cluster.py, executor/launcher.py) ----
class Join(msgspec.Struct, tag="join", array_like=True):
    """The first message on a new connection to the engine's rank listener. A rank joins
    with two connections: ``control`` (then the same messages as a local rank's pipe) and
    ``heartbeat`` (supervisor.py's beats)."""

    rank: int
    channel: str  # "control" or "heartbeat"
    token: str  # $STREAMKV_CLUSTER_TOKEN on the launcher's host ("" when unset)
    world_size: int  # the launcher's $WORLD_SIZE, checked against the engine's; 0: not given
    host: str  # for log lines and error messages
    launcher_pid: int


class Joined(msgspec.Struct, tag="joined", array_like=True):
    pass


JoinReply = Joined | Error


def encode(message: ToWorker | FromWorker) -> bytes:
    return msgspec.msgpack.encode(message)


def worker_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the engine sends (in a worker process)."""
    return msgspec.msgpack.Decoder(ToWorker)


def engine_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what a worker process sends (in the engine)."""
    return msgspec.msgpack.Decoder(FromWorker)


def join_decoder() -> msgspec.msgpack.Decoder:
    """Decodes a new connection's first message (in the engine)."""
    return msgspec.msgpack.Decoder(Join)


def join_reply_decoder() -> msgspec.msgpack.Decoder:
    """Decodes the engine's answer to a Join (in a launcher)."""
    return msgspec.msgpack.Decoder(JoinReply)


def kind(message: msgspec.Struct | type[msgspec.Struct]) -> str:
    """A message's tag, for error messages."""
    cls = message if isinstance(message, type) else type(message)
    return cls.__struct_config__.tag
