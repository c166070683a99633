"""The bounds a request's sampling parameters must respect (docs/api.md, "Limits a request
must respect"), and SamplingParams.verify's checks of them.

The sampler computes in float32 (and the CUDA kernel flushes denormals), so every number must
stay finite there and never round to 0 where 0 changes the meaning: top_p 1e-46 became 0 in
float32 and the nucleus test ``mass above < top_p`` could then never pass (issue 26). Every
list is looked at per step, on the engine thread, so each is capped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamkv.sampling_params import InvalidParameter, SamplingParams

    Bad = Callable[[str, str], InvalidParameter]

GREEDY_EPS = 1e-5  # a temperature below this samples greedily
# Any top_p <= 1/vocab already selects only the most likely token, so 1e-8 loses nothing.
MIN_TOP_P = 1e-8
MAX_TEMPERATURE = 100.0  # past this every distribution is uniform to float32's precision
MIN_REPETITION_PENALTY = 0.01  # a logit divided by less overflows float32
MAX_LENGTH_PENALTY = 10.0  # beam scores divide by len ** length_penalty (Python floats)
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
MAX_CACHE_SALT = 256  # characters
MAX_ALLOWED_TOKEN_IDS = 65536

_F32_TINY = 1.1754943508222875e-38  # float32's smallest normal number


def _real(x: object) -> bool:
    """A finite int or float that float32 holds without underflow: 0 or at least float32's
    smallest normal in magnitude (a denormal is flushed to 0 by the CUDA kernel). A bool is
    not a number here."""
    return (
        isinstance(x, int | float)
        and not isinstance(x, bool)
        and math.isfinite(x)
        and (x == 0 or abs(x) >= _F32_TINY)
    )


def _token_id(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def check_token_counts(p: SamplingParams, bad: Bad) -> None:
    """top_k, max_tokens and min_tokens: integers in range, and min_tokens <= max_tokens."""
    if not isinstance(p.top_k, int) or (p.top_k < 1 and p.top_k != -1):
        raise bad("top_k", "must be 0 or -1 (disable) or at least 1")
    if p.max_tokens is not None and (not isinstance(p.max_tokens, int) or p.max_tokens < 1):
        raise bad("max_tokens", "must be an integer >= 1")
    if not isinstance(p.min_tokens, int) or p.min_tokens < 0:
        raise bad("min_tokens", "must be an integer >= 0")
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise bad("min_tokens", f"must be <= max_tokens ({p.max_tokens})")


def check_structured_conflicts(p: SamplingParams, bad: Bad) -> None:
    """The fields that structured outputs rule out."""
    if p.min_tokens and p.structured_outputs is not None:
        # The grammar decides where a structured output ends (engine/structured.py): a
        # finished grammar allows only a stop token, which min_tokens would ban. Refused
        # rather than dropped.
        raise bad(
            "min_tokens",
            "cannot be combined with structured outputs "
            "(the grammar decides where the output ends)",
        )
    if p.allowed_token_ids is not None and p.structured_outputs is not None:
        # The grammar's mask and the allowed set could leave no token at all.
        raise bad("allowed_token_ids", "cannot be combined with structured outputs")


def check_beam_search(p: SamplingParams, bad: Bad) -> None:
    """What use_beam_search requires of the other fields (structured outputs aside)."""
    if p.best_of < 2:
        raise bad("best_of", "must be >= 2 with use_beam_search (it is the beam width)")
    if p.temperature > GREEDY_EPS:
        raise bad("temperature", "must be 0 with use_beam_search")
    if p.early_stopping not in (True, False, "never"):
        raise bad("early_stopping", "must be True, False or 'never'")
    if p.stop:
        # A stop string would have to be matched in every candidate's text before the beams
        # are chosen; stop_token_ids (which end a hypothesis like EOS) end beams early.
        raise bad("stop", "is not supported with use_beam_search (use stop_token_ids)")


def check_numbers(p: SamplingParams, bad: Bad) -> None:
    """Every float the sampler reads: finite, and in a range where float32 keeps it."""
    if not _real(p.temperature) or not 0.0 <= p.temperature <= MAX_TEMPERATURE:
        raise bad("temperature", f"must be a number in [0, {MAX_TEMPERATURE:g}]")
    if not _real(p.top_p) or not MIN_TOP_P <= p.top_p <= 1.0:
        raise bad(
            "top_p",
            f"must be a number in [{MIN_TOP_P:g}, 1] (any top_p below 1/vocabulary already "
            "keeps only the most likely token)",
        )
    if not _real(p.min_p) or not 0.0 <= p.min_p <= 1.0:
        raise bad("min_p", "must be a number in [0, 1]")
    for name in ("presence_penalty", "frequency_penalty"):
        if not _real(getattr(p, name)) or not -2.0 <= getattr(p, name) <= 2.0:
            raise bad(name, "must be a number in [-2, 2]")
    if not _real(p.repetition_penalty) or not (
        MIN_REPETITION_PENALTY <= p.repetition_penalty <= 2.0
    ):
        raise bad("repetition_penalty", f"must be a number in [{MIN_REPETITION_PENALTY:g}, 2]")
    if not _real(p.length_penalty) or abs(p.length_penalty) > MAX_LENGTH_PENALTY:
        raise bad(
            "length_penalty",
            f"must be a number in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}]",
        )


def check_sizes(p: SamplingParams, bad: Bad) -> None:
    """Stop strings, stop token ids, logit bias, allowed token ids, the resume counters and
    the cache salt: their kinds and counts."""
    if len(p.stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s for s in p.stop):
        raise bad("stop", f"must be at most {MAX_STOP_STRINGS} non-empty strings")
    if any(len(s) > MAX_STOP_CHARS for s in p.stop):
        raise bad("stop", f"strings must be at most {MAX_STOP_CHARS} characters long")
    ids = p.stop_token_ids
    if len(ids) > MAX_STOP_TOKEN_IDS or not all(_token_id(t) for t in ids):
        raise bad("stop_token_ids", f"must be at most {MAX_STOP_TOKEN_IDS} non-negative integers")
    if len(p.logit_bias or ()) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"may hold at most {MAX_LOGIT_BIAS} tokens")
    for t, b in (p.logit_bias or {}).items():
        if not _token_id(t):
            raise bad("logit_bias", "must map non-negative integer token ids to numbers")
        if not _real(b) or not -100.0 <= b <= 100.0:
            raise bad("logit_bias", "values must be numbers in [-100, 100]")
    allowed = p.allowed_token_ids
    if allowed is not None and (
        not isinstance(allowed, list)
        or not allowed
        or len(allowed) > MAX_ALLOWED_TOKEN_IDS
        or not all(_token_id(t) for t in allowed)
    ):
        raise bad(
            "allowed_token_ids",
            f"must be 1 to {MAX_ALLOWED_TOKEN_IDS} non-negative integer token ids",
        )
    for name in ("resumed_output_tokens", "resumed_sample_index"):
        if not _token_id(getattr(p, name)):
            raise bad(name, "must be a non-negative integer")
    salt = p.cache_salt
    if salt is not None and (not isinstance(salt, str) or not 1 <= len(salt) <= MAX_CACHE_SALT):
        raise bad("cache_salt", f"must be a string of 1 to {MAX_CACHE_SALT} characters")
