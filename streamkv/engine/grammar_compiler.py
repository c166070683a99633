"""Grammar compiles off the engine thread, under a time budget, cached by content.

Why: a compile on the engine thread stalls every running stream for as long as it takes
(issue 26: seconds for a large enum or many required properties, minutes for a 1 MB regex).
xgrammar releases the GIL while it compiles, so a compile on its own thread costs the steps
nothing but a share of the CPU.

``CompileCache.request(key, on_done)`` starts (or joins) the compile of ``key`` and calls
``on_done`` from a compile thread once the outcome is known; ``outcome(key)`` is then the
compiled grammar or the InvalidParameter that refused it. A compile still running after
``timeout_s`` is refused ("took longer than ..."), and that refusal is what the cache keeps:
the same hostile spec sent again is refused at once. A late result is dropped. Keys are a
digest of the spec's canonical text, so the cache holds no request text.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from streamkv.sampling_params import InvalidParameter

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 10.0
# Two compile threads: one hostile spec that runs to its budget does not hold up every other
# request's grammar, and the shared CPU box keeps its cores for the steps.
COMPILE_THREADS = 2


def spec_digest(kind: str, text: str) -> str:
    return hashlib.blake2b(
        f"{kind}\0{text}".encode("utf-8", "surrogatepass"), digest_size=16
    ).hexdigest()


class CompileCache:
    """Compiled grammars (or refusals) by spec digest, LRU, and the compiles in flight."""

    def __init__(
        self, compile_fn: Callable[[str, str], Any], size: int, timeout_s: float = COMPILE_TIMEOUT_S
    ) -> None:
        self._compile = compile_fn  # (kind, text) -> compiled; raises InvalidParameter
        self._size = size
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._done: OrderedDict[str, Any] = OrderedDict()  # digest -> compiled | InvalidParameter
        self._waiting: dict[str, list[Callable[[], None]]] = {}  # digest -> callbacks
        self._pool: ThreadPoolExecutor | None = None

    def outcome(self, kind: str, text: str) -> Any | None:
        """The compiled grammar, the InvalidParameter refusing it, or None (not known yet)."""
        key = spec_digest(kind, text)
        with self._lock:
            hit = self._done.get(key)
            if hit is not None:
                self._done.move_to_end(key)
            return hit

    def request(self, kind: str, text: str, on_done: Callable[[], None]) -> bool:
        """Start or join the compile of (kind, text); False when its outcome is known already
        (``on_done`` is then not called)."""
        key = spec_digest(kind, text)
        with self._lock:
            if key in self._done:
                return False
            waiting = self._waiting.get(key)
            if waiting is not None:
                waiting.append(on_done)
                return True
            self._waiting[key] = [on_done]
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    COMPILE_THREADS, thread_name_prefix="streamkv-grammar"
                )
        # The budget counts from the request, queueing behind other compiles included.
        timer = threading.Timer(
            self.timeout_s, self._settle, (key, _too_slow(kind, self.timeout_s))
        )
        timer.daemon = True
        timer.start()
        self._pool.submit(self._run, key, kind, text, timer)
        return True

    def compile_now(self, kind: str, text: str) -> Any:
        """The outcome, waiting for the compile (at most the budget): for callers that may
        block, such as the offline ``LLM``. Returns the compiled grammar or raises."""
        done = threading.Event()
        if self.request(kind, text, done.set):
            done.wait(self.timeout_s + 1.0)
        result = self.outcome(kind, text)
        if result is None:  # cannot happen: the timer settles it (a safety net)
            result = _too_slow(kind, self.timeout_s)
        if isinstance(result, InvalidParameter):
            raise InvalidParameter(result.param, str(result), result.code)
        return result

    def _run(self, key: str, kind: str, text: str, timer: threading.Timer) -> None:
        try:
            result: Any = self._compile(kind, text)
        except InvalidParameter as e:
            result = e
        except Exception as e:  # noqa: BLE001 - the grammar engine's own failure is this request's
            logger.exception("compiling a %s grammar failed", kind)
            result = InvalidParameter(
                "structured_outputs", f"structured_outputs: the {kind} cannot be compiled: {e}"
            )
        timer.cancel()
        self._settle(key, result)

    def _settle(self, key: str, result: Any) -> None:
        with self._lock:
            callbacks = self._waiting.pop(key, None)
            if callbacks is None:
                return  # settled already (a late compile after its budget ran out)
            self._done[key] = result
            while len(self._done) > self._size:
                self._done.popitem(last=False)
        for fn in callbacks:
            try:
                fn()
            except Exception:  # noqa: BLE001 - one waiter's failure must not strand the rest
                logger.exception("a grammar compile callback failed")

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _too_slow(kind: str, budget: float) -> InvalidParameter:
    return InvalidParameter(
        "structured_outputs",
        f"structured_outputs: the {kind} took longer than {budget:g} s to compile; "
        'simplify it (docs/api.md, "Limits a request must respect").',
    )
