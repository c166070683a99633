"""Structured outputs on the engine side: compile a request's StructuredOutputs once, keep a
grammar matcher per sequence, and hand each step the token mask of every structured row.

The grammar engine is xgrammar (docs/architecture.md, "Structured outputs": on SmolLM2's
49,152-token vocabulary it fills a mask and accepts a token in ~5 us, llguidance in ~36 us).
Life of a structured sequence:

- A spec is checked against static limits (engine/grammar_limits.py) and compiled on a
  compile thread under a time budget, cached by a digest of its canonical form
  (engine/grammar_compiler.py). The server's engine thread never compiles: ``defer``
  starts the compile and the submission comes back once it is done (engine_commands.py).
  ``new_grammar`` (LLMEngine.add_request) then finds the outcome, so a spec past a limit
  or one the grammar engine refuses is an InvalidParameter before the request queues, and
  gives the prompt's sequence its matcher.
- The mask of a sequence's *next* token is filled when it is needed, from the matcher's
  state after the last accepted token: by the step builder, which sends it as
  ``SeqStep.token_mask``, or, when the step was built while that token was still being
  sampled (async scheduling), once it is accepted, for every such row of the step in one
  batched call (``fill_masks``, into the pinned buffer the sampler uploads: MaskStaging in
  layers/token_mask.py; engine/step_pipeline.py). The sampler bans every token outside it.
- A step's structured rows accept their sampled tokens in one native call
  (``accept_tokens``, from OutputProcessor).
- ``SequenceGrammar.accept`` (OutputProcessor.check_stop) advances the matcher with each
  sampled token. When the grammar is complete and only a stop token could follow, the
  sequence ends with finish_reason "stop" at once, rather than spend a step sampling EOS.
- n > 1: a fork (Sequence.fork) forks the matcher, a deep copy of its parse state.

xgrammar is imported on a background thread when the engine starts (engine/background_import.py).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from streamkv.engine.background_import import BackgroundImport
from streamkv.engine.grammar_compiler import COMPILE_TIMEOUT_S, CompileCache
from streamkv.engine.grammar_limits import check_spec
from streamkv.sampling_params import InvalidParameter, SamplingParams, StructuredOutputs

logger = logging.getLogger(__name__)

# Compiled grammars kept (LRU): a server sees the same few schemas over and over.
COMPILE_CACHE_SIZE = 256
# Threads of the batched mask fill (engine/step_pipeline.py): one. On the H200's 16-core host
# xgrammar's pool cost more than it saved: a step's fill (up to 64 rows) took ~1.6 ms more
# with 8 threads than with 1, where a row's own fill takes ~5 us (docs/benchmarks.md,
# "Structured outputs").
FILL_THREADS = 1


class SequenceGrammar:
    """One sequence's matcher and the mask of its next token, filled when first asked for."""

    __slots__ = ("matcher", "handle", "mask", "stop_words", "stop_ids", "_stop_free", "_filled")

    def __init__(
        self, matcher: Any, mask: np.ndarray, stop_words: np.ndarray, stop_ids: frozenset[int]
    ) -> None:
        self.matcher = matcher
        self.handle = matcher._handle  # the native matcher, for accept_tokens' one call a step
        self.mask = mask  # int32 [1, words]
        self.stop_words = stop_words  # the mask's words with every stop token's bit cleared
        self.stop_ids = stop_ids  # the matcher's stop tokens (TokenizerInfo's stop_token_ids)
        self._stop_free = np.empty_like(mask)
        self._filled = False  # ``mask`` is of the matcher's current state

    def next_mask(self) -> np.ndarray:
        if not self._filled:
            self.matcher.fill_next_token_bitmask(self.mask)
            self._filled = True
        return self.mask

    def mask_bytes(self) -> bytes:
        return self.next_mask().tobytes()

    def accept(self, token: int) -> bool:
        """Advance by ``token``; True when the sequence must end here: the grammar is done
        (a stop token accepted, or nothing but one may follow), or the token broke it."""
        return self._accepted(token, self.matcher.accept_token(token))

    def _accepted(self, token: int, ok: bool) -> bool:
        """``accept``'s verdict once the matcher has taken (``ok``) or refused ``token``."""
        if not ok:
            # Only a bug can get here (the sampler bans every token outside the mask), or a
            # row whose every allowed token was also banned (stop_token_ids): end the output
            # where it stands instead of feeding the grammar more.
            logger.warning(
                "structured output: token %d is outside its grammar; ending the sequence", token
            )
            return True
        self._filled = False
        # A matcher terminates exactly when it accepts one of its stop tokens: asking it
        # (is_terminated) would cost a native call a row and step (~1 us). The native
        # matcher's own is_completed: 64 rows in 13 us against 28 us through the Python
        # wrapper (CPU box).
        return token in self.stop_ids or (self.handle.is_completed() and self._only_stops_left())

    def _only_stops_left(self) -> bool:
        """Whether the completed grammar allows nothing but a stop token next (the mask is
        needed now only when the grammar could end here)."""
        np.bitwise_and(self.next_mask(), self.stop_words, out=self._stop_free)
        return not self._stop_free.any()

    def fork(self) -> SequenceGrammar:
        child = SequenceGrammar(
            self.matcher.fork(), self.mask.copy(), self.stop_words, self.stop_ids
        )
        child._filled = self._filled
        return child


def accept_tokens(grammars: list[SequenceGrammar], tokens: list[int]) -> list[bool]:
    """``grammars[i].accept(tokens[i])`` for every i (OutputProcessor: a step's structured
    rows), the matchers advanced in one native call: each native call releases and re-takes
    the GIL, which a busy thread (the server's event loop) can make cost far more than the
    call. The call is xgrammar's own below its Python wrapper: the wrapper turns the result
    into a list of bools at ~1.7 us a row (tvm_ffi's Array indexing), more than a per-row
    accept_token (~1.4 us); testing the result for a 0 is one native call. 64 rows on the
    CPU box: 92 us per row, 160 us through the wrapper, 49 us here."""
    from xgrammar.base import _core  # xgrammar >= 0.2.9 (pyproject.toml)

    accepted = _core.BatchGrammarMatcher.batch_accept_token(
        [g.handle for g in grammars], tokens, False
    )
    if 0 in accepted:  # a refused token (a bug, or a row whose allowed tokens were all banned)
        return [
            g._accepted(t, bool(ok))
            for g, t, ok in zip(grammars, tokens, list(accepted), strict=True)
        ]
    # Every token taken: no need to index the native result row by row (the slow part).
    return [g._accepted(t, True) for g, t in zip(grammars, tokens, strict=True)]


class StructuredOutputManager:
    """Compiles specs for one tokenizer and makes matchers. xgrammar is imported in the
    background from the start (a model without a tokenizer cannot use it: not then); its
    tokenizer table is built on the first structured request, so engines that never see
    one pay only the import, off their thread."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        compile_timeout_s: float = COMPILE_TIMEOUT_S,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width: the mask covers every row entry
        self.eos_token_ids = sorted(eos_token_ids)
        self._stop_ids = frozenset(eos_token_ids)
        self.xgrammar = BackgroundImport("xgrammar") if tokenizer is not None else None
        self._compiler: Any = None
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher: fill_masks
        self._staging: Any = None  # layers/token_mask.py's MaskStaging: where fill_masks writes
        self._stop_words: np.ndarray | None = None
        self._setup_lock = threading.Lock()  # the first compiles may run on two threads
        self._cache = CompileCache(self._compile, COMPILE_CACHE_SIZE, compile_timeout_s)

    def defer(self, params: SamplingParams, resume: Callable[[], None]) -> bool:
        """True when the request's grammar is compiling now, off this thread: ``resume`` is
        called (on a compile thread) once it is done, and the request should be added then.
        False when there is nothing to wait for (its outcome is cached)."""
        if self.tokenizer is None:
            return False
        return self._cache.request(*params.structured_outputs.key(), resume)

    def new_grammar(self, params: SamplingParams) -> SequenceGrammar:
        """A fresh matcher for a structured request; InvalidParameter if its grammar does
        not compile. Waits for the compile (at most its budget) unless ``defer`` ran first."""
        compiled = self._compiled(params.structured_outputs)  # sets xgrammar up
        xgr = self.xgrammar.get()
        matcher = xgr.GrammarMatcher(compiled)
        return SequenceGrammar(
            matcher,
            xgr.allocate_token_bitmask(1, self.vocab_size).numpy(),
            self._stop_words,
            self._stop_ids,
        )

    def fill_masks(self, grammars: list[SequenceGrammar]) -> list:
        """The next-token masks of ``grammars`` (StagedMask i for grammar i), filled in one
        native call (xgrammar's BatchGrammarMatcher on FILL_THREADS threads) straight into
        the persistent pinned buffer the sampler uploads (MaskStaging, layers/token_mask.py); valid
        until the next call. The grammars' own masks are left as they are."""
        if not grammars:
            return []
        matchers = [g.matcher for g in grammars]
        return self._staging.fill(
            len(grammars), lambda words: self._batch.batch_fill_next_token_bitmask(matchers, words)
        )

    def _compiled(self, spec: StructuredOutputs) -> Any:
        if self.tokenizer is None:
            self._setup()  # raises: no tokenizer, no grammar
        return self._cache.compile_now(*spec.key())

    def shutdown(self) -> None:
        self._cache.shutdown()

    def _compile(self, kind: str, text: str) -> Any:
        """On a compile thread: the static limits first, then the grammar engine."""
        check_spec(kind, text)
        with self._setup_lock:
            compiler = self._setup()
        try:
            if kind == "json":
                # Whitespace as json.dumps writes it (", " and ": "): free whitespace lets a
                # small model pad an object with newlines until max_tokens.
                return compiler.compile_json_schema(text, any_whitespace=False)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                return compiler.compile_regex("|".join(_regex_literal(c) for c in json.loads(text)))
            return compiler.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError) as e:
            # xgrammar reports a bad schema, pattern or grammar as one of these, with the
            # position of the problem in its message.
            why = _LOG_PREFIX.sub("", str(e)).strip()
            raise InvalidParameter(
                "structured_outputs", f"structured_outputs: the {kind} cannot be compiled: {why}"
            ) from None

    def _setup(self) -> Any:
        if self._compiler is None:
            if self.tokenizer is None:
                raise InvalidParameter(
                    "structured_outputs",
                    "structured_outputs needs the model's tokenizer, and this model has none.",
                )
            xgr = self.xgrammar.get()  # waits for the background import, if it still runs
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
            )
            # One compile thread: the engine's thread compiles on admission, on a shared host.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            self._batch = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
            # Imported here: torch, not before a structured request.
            from streamkv.layers.token_mask import MaskStaging

            self._staging = MaskStaging(-(-self.vocab_size // 32))
            stop = np.full((1, -(-self.vocab_size // 32)), -1, dtype=np.int32)
            for t in self.eos_token_ids:
                stop[0, t // 32] &= _clear_bit(t)
            self._stop_words = stop
        return self._compiler


def _clear_bit(token: int) -> np.int32:
    """An int32 word with every bit set except ``token``'s."""
    return np.array(~(1 << (token % 32)) & 0xFFFF_FFFF, dtype=np.uint32).view(np.int32)


# xgrammar's messages start with "[time] path/file.cc:line: ".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_REGEX_SPECIAL = set(r"\.^$|?*+()[]{}/")


def _regex_literal(text: str) -> str:
    """``text`` as a regex matching exactly it (xgrammar's regex dialect is ECMAScript's)."""
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)
