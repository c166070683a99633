"""The engine core in a process of its own, as vLLM v1 splits its API server from its
EngineCore: the server's event loop and the engine thread no longer share one GIL.

Under a burst of streams the engine thread spends ~10 ms of Python per step (scheduling,
step building, output processing) and the event loop ~8 ms (one SSE event per stream),
against a ~17 ms GPU step: sharing one GIL, the server could not keep the GPU busy
(docs/benchmarks.md "Where the served time goes"). Here the child process runs the very
same ``EngineThread`` and ``EngineCommands``; this module only carries what crosses:

- to the child: submissions, aborts, calls (a picklable ``fn(engine)``), "handed" after a
  restart, stop;
- to the server: ready (with the engine's info and its tokenizer), the step outputs and the
  scheduler's waiting count, the verdicts on submissions, restarts and stalls, the engine's
  stats, the calls' results, and death.

Outputs cross as deltas (``OutputDeltas``): a running request's output is cumulative, and
pickling it whole every step cost the server's reader thread as much CPU as the engine
thread it relieved (an H200 burst: 0.73x the offline engine). Each step sends only what a
choice added since the last step; the server appends it to the output it keeps, on its event
loop. Messages are pickled over a socket pair between the server and the process it started
(no other peer can write to it). ``EngineProcess`` has the face of ``EngineThread`` and
``RemoteCommands`` that of ``EngineCommands``, so ``AsyncEngine`` runs either.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

from streamkv.engine.engine_commands import EngineCommands, Submission
from streamkv.engine.engine_thread import EngineThread, LoopSide
from streamkv.engine.recovery import RestartBudget
from streamkv.engine.serving_logs import StatsLogger
from streamkv.engine.tokenizer_lanes import TokenizerLanes
from streamkv.engine.watchdog import STEP_TIMEOUT_S
from streamkv.sequence import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineSpec:
    """What the child needs to build the engine (pickled to it). How it runs (restart
    budget, stats intervals, step timeout) is AsyncEngine's to say: ``EngineProcess`` fills
    in ``run`` from its arguments, so both modes read the same ones."""

    config: Any  # EngineConfig
    chat_template: str | None = None
    log_level: int = logging.INFO
    run: RunSettings | None = None


@dataclass(slots=True)
class RunSettings:
    restarts: RestartBudget
    stats_interval: float
    log_stats_interval: float | None
    step_timeout_s: float = STEP_TIMEOUT_S


def build_from_spec(spec: EngineSpec):
    from streamkv.entrypoints.cli_common import set_chat_template
    from streamkv.entrypoints.llm import build_engine
    from streamkv.models.loader import phase

    with phase("loading the model and allocating the KV cache"):
        engine = build_engine(spec.config)
    if spec.chat_template is not None:
        set_chat_template(engine.tokenizer, spec.chat_template)  # again after a worker restart
    return engine


class _Pipe:
    """One end of the socket pair; sends from several threads, one at a time."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, *msg: Any) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self.conn.send_bytes(data)

    def recv(self) -> tuple:
        return pickle.loads(self.conn.recv_bytes())


class OutputDeltas:
    """Both ends of the output stream. The child's ``encode`` turns a step's outputs into
    rows of what is new since the last step; the server's ``decode`` rebuilds the outputs
    from them. A choice whose text, tokens or logprobs did not only grow since the last row
    (a beam reordered, a request resumed after a restart) goes whole."""

    def __init__(self) -> None:
        # The child: each running request's choices as last sent; the server: its rebuilt output.
        self._last: dict[str, list[_Sent] | RequestOutput] = {}

    def forget(self, request_id: str | None = None) -> None:
        if request_id is None:
            self._last.clear()
        else:
            self._last.pop(request_id, None)

    # -- the child ----------------------------------------------------------------------------
    def encode(self, outs: list[RequestOutput]) -> list[tuple]:
        rows = []
        for out in outs:
            prev = self._last.get(out.request_id)
            if prev is None:
                rows.append((out.request_id, out))  # whole, the first time
            else:
                choices = [_choice_delta(p, c) for p, c in zip(prev, out.outputs)]
                choices += out.outputs[len(prev):]
                rows.append((out.request_id, out.finished, out.error, out.metrics, choices))
            if out.finished:
                self._last.pop(out.request_id, None)
            else:
                self._last[out.request_id] = [_Sent(c.index, len(c.text), len(c.token_ids),
                                                    None if c.logprobs is None else len(c.logprobs))
                                              for c in out.outputs]
        return rows

    # -- the server ---------------------------------------------------------------------------
    def decode(self, rows: list[tuple]) -> list[RequestOutput]:
        outs = []
        for row in rows:
            if len(row) == 2:
                out = row[1]
            else:
                rid, finished, error, metrics, choices = row
                prev = self._last.get(rid)
                if prev is None:  # forgotten (a restart): cannot happen for a delta row
                    continue
                out = RequestOutput(rid, prev.prompt, prev.prompt_token_ids,
                                    [_apply(prev.outputs[k] if k < len(prev.outputs) else None, c)
                                     for k, c in enumerate(choices)],
                                    finished, error, metrics, prev.prompt_logprobs)
            if out.finished:
                self._last.pop(out.request_id, None)
            else:
                self._last[out.request_id] = out
            outs.append(out)
        return outs


class _Sent(NamedTuple):
    """What the child remembers of a choice it sent: its sample and its lengths."""

    index: int
    text_len: int
    num_tokens: int
    num_logprobs: int | None


def _choice_delta(prev: _Sent, c: CompletionOutput) -> tuple | CompletionOutput:
    """(index, new text, new token ids, new logprobs, cumulative logprob, finish, stop), or
    the choice whole when it did not only grow."""
    _, text_len, num_tokens, num_lps = prev
    if (prev.index != c.index or len(c.text) < text_len or len(c.token_ids) < num_tokens
            or (c.logprobs is None) != (num_lps is None) or (num_lps is not None and len(c.logprobs) < num_lps)):
        return c
    return (c.index, c.text[text_len:], c.token_ids[num_tokens:],
            None if c.logprobs is None else c.logprobs[num_lps:],
            c.cumulative_logprob, c.finish_reason, c.stop_reason)


def _apply(prev: CompletionOutput | None, c: tuple | CompletionOutput) -> CompletionOutput:
    if isinstance(c, CompletionOutput):
        return c
    index, text, ids, lps, cumulative, finish, stop = c
    # The lists grow in place: only the newest output of a request is ever read.
    prev.token_ids.extend(ids)
    if lps is not None:
        prev.logprobs.extend(lps)
    return CompletionOutput(index, prev.text + text, prev.token_ids, cumulative, prev.logprobs, finish, stop)


# -- the server's side ---------------------------------------------------------------------
class RemoteCommands(EngineCommands):
    """``EngineCommands`` whose queue is the child's: each command is sent at once."""

    def __init__(self) -> None:
        super().__init__()
        self.pipe: _Pipe | None = None
        self._waiting: dict[str, Submission] = {}  # sent, verdict not yet back
        self.forget: Callable[[str], None] = lambda request_id: None  # EngineProcess's output deltas

    def submit(self, sub: Submission) -> None:
        self._waiting[sub.request_id] = sub
        self.pipe.send("add", [_plain(sub)])

    def resubmit_first(self, subs: list[Submission]) -> None:
        for sub in subs:
            self._waiting[sub.request_id] = sub
        self.pipe.send("add_first", [_plain(s) for s in subs])

    def abort(self, request_id: str) -> None:
        self.forget(request_id)  # an aborted request's output may never come: drop what is kept of it
        self.pipe.send("abort", request_id)

    def call(self, fn: Callable) -> None:
        raise TypeError("the engine runs in another process: use AsyncEngine.run_on_engine")

    def wake(self) -> None:
        pass

    def fail_submissions(self, error: BaseException) -> None:
        for sub in self._waiting.values():
            if not sub.accepted.done():
                sub.accepted.set_exception(error)
        self._waiting.clear()

    def verdicts(self, raw: list[tuple[str, BaseException | None]]) -> list[tuple[Submission, BaseException | None]]:
        return [(self._waiting.pop(rid), error) for rid, error in raw if rid in self._waiting]


def _plain(sub: Submission) -> tuple:
    return sub.request_id, sub.prompt, sub.params, sub.prompt_token_ids, sub.arrival_time


class _Handed:
    """The child's restart waits until the server has queued the resumed requests."""

    def __init__(self, pipe: _Pipe) -> None:
        self.pipe = pipe

    def set(self) -> None:
        self.pipe.send("handed")


class EngineProcess:
    """``EngineThread``'s face for an engine in a child process. ``info``, ``tokenizer``
    and ``stats`` are copies the child sends; ``engine`` is always None here."""

    engine = None

    def __init__(self, spec: EngineSpec, commands: RemoteCommands, side: LoopSide, lanes: TokenizerLanes,
                 run: RunSettings) -> None:
        self._spec = dataclasses.replace(spec, run=run)
        self._commands, self._side, self._lanes = commands, side, lanes
        self.info: Any = None
        self.tokenizer: Any = None
        self.stats: dict = {}
        self._proc: subprocess.Popen | None = None
        self._pipe: _Pipe | None = None
        self._loop = None
        self._calls: dict[int, Callable[[Any, BaseException | None], None]] = {}
        self._next_call = 0
        self._stopping = False
        self._deltas = OutputDeltas()  # touched on the event loop only
        commands.forget = self._deltas.forget

    @property
    def started(self) -> bool:
        return self._proc is not None

    def start(self, loop) -> None:
        self._loop = loop
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent.parent)  # the same streamkv, installed or not
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "streamkv.engine.engine_process", str(theirs.fileno())],
                                          pass_fds=(theirs.fileno(),), env=env)
        finally:
            theirs.close()
        self._pipe = _Pipe(Connection(ours.detach()))
        self._commands.pipe = self._pipe
        self._pipe.send("spec", self._spec)
        threading.Thread(target=self._read, name="streamkv-engine-reader", daemon=True).start()

    def stop(self) -> None:
        self._stopping = True
        try:
            self._pipe.send("stop")
        except OSError:
            pass

    def join(self, timeout: float | None = None) -> bool:
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def run(self, fn: Callable, done: Callable[[Any, BaseException | None], None]) -> None:
        """``fn(engine)`` in the child between two steps; ``done(result, error)`` on the loop."""
        self._next_call += 1
        self._calls[self._next_call] = done
        self._pipe.send("call", self._next_call, fn)

    def _outputs(self, rows: list[tuple], waiting: int) -> None:
        self._side.outputs(self._deltas.decode(rows), waiting)

    def _read(self) -> None:
        post, side = self._loop.call_soon_threadsafe, self._side
        while True:
            try:
                msg = self._pipe.recv()
            except (EOFError, OSError):
                break
            except Exception:  # noqa: BLE001 - one message lost, not the engine
                logger.exception("a message from the engine process could not be read")
                continue
            kind = msg[0]
            if kind == "out":
                post(self._outputs, msg[1], msg[2])
            elif kind == "verdicts":
                post(lambda raw=msg[1], w=msg[2]: side.verdicts(self._commands.verdicts(raw), w))
            elif kind == "stats":
                self.stats = msg[1]
            elif kind == "result":
                done = self._calls.pop(msg[1], None)
                if done is not None:
                    post(done, msg[2], msg[3])
            elif kind == "ready":
                self.info, self.tokenizer, self.stats = msg[1], msg[2], msg[3]
                self._lanes.set_tokenizer(self.tokenizer)
                post(side.ready)
            elif kind == "restarted":  # the resumed requests' outputs start again, whole
                self.stats = msg[2]
                post(self._deltas.forget)
                post(side.restarted, _Handed(self._pipe), msg[1])
            elif kind == "recovering":
                post(side.recovering, msg[1])
            elif kind == "stalled":
                post(side.stalled, msg[1])
            elif kind == "dead":
                post(side.dead, msg[1])
                return
        code = self._proc.wait()
        if not self._stopping:
            logger.error("the engine process exited with code %s", code)
            post(side.dead, RuntimeError(f"the engine process exited with code {code}"))


# -- the child's side ----------------------------------------------------------------------
class _Direct:
    """The child has no event loop: the engine thread's posts run where they are made."""

    @staticmethod
    def call_soon_threadsafe(fn: Callable, *args: Any) -> None:
        fn(*args)


def serve(conn: Connection) -> None:
    # Ctrl-C reaches the whole process group: the server drains and then stops this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pipe = _Pipe(conn)
    kind, spec = pipe.recv()
    assert kind == "spec"
    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    commands = EngineCommands()
    deltas = OutputDeltas()  # touched on the engine thread only
    handed = threading.Event()
    holder: dict[str, EngineThread] = {}

    def ready() -> None:
        t = holder["thread"]
        pipe.send("ready", t.info, t.tokenizer, t.stats)

    def restarted(event: threading.Event, stalled: str | None) -> None:
        deltas.forget()
        handed.clear()
        pipe.send("restarted", stalled, holder["thread"].stats)
        handed.wait()
        event.set()

    side = LoopSide(
        ready=ready,
        dead=lambda e: pipe.send("dead", _picklable(e)),
        recovering=lambda why: pipe.send("recovering", why),
        restarted=restarted,
        stalled=lambda why: pipe.send("stalled", why),
        outputs=lambda outs, waiting: pipe.send("out", deltas.encode(outs), waiting),
        verdicts=lambda vs, waiting: pipe.send("verdicts", [(s.request_id, _picklable(e)) for s, e in vs], waiting),
    )
    run = spec.run
    thread = EngineThread(lambda: build_from_spec(spec), commands, side, TokenizerLanes(), run.restarts,
                          run.stats_interval,
                          StatsLogger(run.log_stats_interval) if run.log_stats_interval is not None else None,
                          run.step_timeout_s)
    holder["thread"] = thread
    thread.start(_Direct())
    threading.Thread(target=_send_stats, args=(pipe, thread, run.stats_interval), daemon=True).start()
    while True:
        try:
            msg = pipe.recv()
        except (EOFError, OSError):  # the server is gone
            break
        kind = msg[0]
        if kind == "add":
            for sub in msg[1]:
                commands.submit(Submission(*sub, accepted=None))
        elif kind == "add_first":
            commands.resubmit_first([Submission(*sub, accepted=None) for sub in msg[1]])
        elif kind == "abort":
            commands.abort(msg[1])
            commands.call(lambda engine, rid=msg[1]: deltas.forget(rid))
        elif kind == "call":
            commands.call(lambda engine, call_id=msg[1], fn=msg[2]: _answer(pipe, call_id, fn, engine))
        elif kind == "handed":
            handed.set()
        elif kind == "stop":
            break
    thread.stop()
    thread.join(10.0)
    if thread.engine is not None:
        thread.engine.shutdown()


def _answer(pipe: _Pipe, call_id: int, fn: Callable, engine) -> None:
    try:
        result, error = fn(engine), None
    except Exception as e:  # noqa: BLE001 - handed back to the caller
        result, error = None, e
    pipe.send("result", call_id, result, _picklable(error))


def _send_stats(pipe: _Pipe, thread: EngineThread, interval: float) -> None:
    last = None
    while True:
        time.sleep(interval)
        stats = thread.stats
        if stats is not last:
            last = stats
            try:
                pipe.send("stats", stats)
            except OSError:
                return


def _picklable(error: BaseException | None) -> BaseException | None:
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - its kind, text and field are what the server reports
        plain = ValueError(str(error)) if isinstance(error, ValueError) else RuntimeError(f"{type(error).__name__}: {error}")
        for attr in ("param", "code"):
            if hasattr(error, attr):
                setattr(plain, attr, getattr(error, attr))
        return plain


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
