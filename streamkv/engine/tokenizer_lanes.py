"""Tokenization off the event loop, in two lanes so that one client's huge prompt cannot
hold everyone else's small one.

A single FIFO thread let six concurrent 1.9 MB ``/tokenize`` calls raise another client's
10-token completion from 0.49 s to 7.75 s (issue 13): it queued behind ~8 s of encoding.
Here inputs of at most ``small_chars`` characters run on their own thread and so wait only
behind other small inputs (each at most ~12 ms: SmolLM2's tokenizer encodes ~1.4 M
characters/s on the CPU box); larger ones run one at a time on a second thread, with at
most ``max_large_waiting`` waiting, and beyond that the caller gets ``TokenizerBusyError``.
The two lanes run at once because the fast tokenizer's ``encode`` releases the GIL.
Each lane has its own tokenizer object: the Rust tokenizer is not safe to share between
threads once truncation or padding settings are touched.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

SMALL_CHARS = 16_384
MAX_LARGE_WAITING = 4


class TokenizerBusyError(RuntimeError):
    """Too many large tokenizations are queued already; retry later."""


class TokenizerLanes:
    def __init__(
        self, small_chars: int = SMALL_CHARS, max_large_waiting: int = MAX_LARGE_WAITING
    ) -> None:
        self.small_chars, self.max_large_waiting = small_chars, max_large_waiting
        self._small = ThreadPoolExecutor(1, thread_name_prefix="streamkv-tokenizer")
        self._large = ThreadPoolExecutor(1, thread_name_prefix="streamkv-tokenizer-large")
        self._tokenizer: Any = None
        self._large_tokenizer: Any = None
        self._large_queued = 0  # running or waiting on the large lane (event-loop side only)

    def set_tokenizer(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    async def run(self, fn: Callable[[Any], T], size: int) -> T:
        """``fn(tokenizer)`` on the lane for an input of ``size`` characters."""
        loop = asyncio.get_running_loop()
        if size <= self.small_chars:
            return await loop.run_in_executor(self._small, fn, self._tokenizer)
        if self._large_queued > self.max_large_waiting:  # one running + this many waiting
            raise TokenizerBusyError(
                f"{self._large_queued} large inputs (over {self.small_chars} characters) are being "
                f"tokenized already; retry later"
            )
        self._large_queued += 1
        try:
            return await loop.run_in_executor(self._large, self._run_large, fn)
        finally:
            self._large_queued -= 1

    def _run_large(self, fn: Callable[[Any], T]) -> T:
        if self._large_tokenizer is None:  # ~0.1 s once, on this lane's own thread
            self._large_tokenizer = copy.deepcopy(self._tokenizer)
        return fn(self._large_tokenizer)

    def shutdown(self) -> None:
        self._small.shutdown(wait=False, cancel_futures=True)
        self._large.shutdown(wait=False, cancel_futures=True)
