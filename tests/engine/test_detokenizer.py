"""The incremental detokenizer decodes through the fast tokenizer's backend when there is one,
and gives the same text as through transformers' decode, byte pieces and all; the stop-string
hold-back is exact for short stop strings and costs O(1) per long one."""

from __future__ import annotations

import random
import timeit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamkv.engine.detokenizer import EXACT_HOLDBACK_CHARS, Detokenizer, holdback
from streamkv.models.loader import load_tokenizer, resolve_model_dir
from streamkv.sequence import Sequence

TEXT = "Héllo wörld 😊🏖️ — “quotes”,  double  spaces, 中文 and\ttabs\n"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model_dir(None))


def _stream(detok: Detokenizer, prompt: list[int], output: list[int]) -> tuple[str, list[str]]:
    seq = Sequence(0, list(prompt))
    pieces = []
    for t in output:
        seq.output_token_ids.append(t)
        pieces.append(detok.update(seq))
    return seq.output_text, pieces


def test_backend_and_wrapper_decode_the_same_stream(tok):
    fast = Detokenizer(tok)
    assert fast.uses_backend  # SmolLM2 ships a fast tokenizer
    slow = Detokenizer(tok, use_backend=False)  # transformers' decode
    assert not slow.uses_backend
    prompt = tok("Say something:").input_ids
    output = tok(TEXT).input_ids + [tok.eos_token_id]
    text, pieces = _stream(fast, prompt, output)
    assert (text, pieces) == _stream(slow, prompt, output)
    assert text == tok.decode(output, skip_special_tokens=True)
    assert "\ufffd" not in "".join(pieces)  # half characters wait for their other bytes


# -- stop-string hold-back ----------------------------------------------------------------
def _holdback_reference(text: str, stops: list[str]) -> int:
    return max(
        (k for s in stops for k in range(min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])),
        default=0,
    )


@settings(max_examples=200, deadline=None)
@given(
    st.text("ab\n", max_size=14),
    st.lists(st.text("ab\n", min_size=1, max_size=8), min_size=1, max_size=3),
)
def test_holdback_is_the_longest_suffix_that_begins_a_stop_string(text, stops):
    assert holdback(text, stops) == _holdback_reference(text, stops)


@settings(max_examples=100, deadline=None)
@given(
    st.text("ab", max_size=40),
    st.lists(st.text("ab", min_size=1, max_size=90), min_size=1, max_size=3),
)
def test_emitted_text_only_grows(text, stops):
    """What the stream shows (text minus its hold-back) never shrinks as text is appended,
    for short stop strings (exact) and long ones (len - 1 held) alike."""
    shown = [len(text[:i]) - holdback(text[:i], stops) for i in range(len(text) + 1)]
    assert shown == sorted(shown)
    long_stop = [s for s in stops if len(s) > EXACT_HOLDBACK_CHARS]
    for i in range(len(text) + 1):
        assert holdback(text[:i], stops) >= _holdback_reference(text[:i], stops)
        if long_stop:
            assert holdback(text[:i], stops) >= min(i, len(long_stop[0]) - 1)


def _cost(text: str, stops: list[str], repeat: int = 20) -> float:
    return min(timeit.repeat(lambda: holdback(text, stops), number=1, repeat=repeat))


def test_holdback_cost_does_not_grow_with_stop_or_text_length():
    """Issue 13: trying every k cost O(len(stop)^2) per stop per step (6.5 ms for 32 stops
    of 1 KB on 16 K characters of text, against ~20 us for 8-character stops). Now long stop
    strings cost O(1) and short ones at most EXACT_HOLDBACK_CHARS^2 character compares."""
    random.seed(0)
    words = "the sea is calm tonight and the tide is full moon lies fair upon straits".split()
    prose = " ".join(random.choice(words) for _ in range(4000))
    short = [prose[i : i + 8] for i in range(0, 32 * 8, 8)]
    long = [prose[i : i + 1024] for i in range(0, 32 * 1024, 1024)]
    base = _cost(prose[:16_000], short)
    assert _cost(prose[:16_000], long) < 5 * base + 1e-4
    assert _cost(prose, short) < 5 * base + 1e-4  # 4x the text, same cost
    periodic = ["ab" * 31 + "c"] * 32  # many candidate k, each a long compare: the exact worst case
    assert _cost(("ab" * 20 + "x") * 3 + "ab" * 30, periodic) < 2e-3


# -- the one-decode-per-token scheme against the plain two-window algorithm ----------------
def _reference_stream(tok, prompt: list[int], output: list[int], skip_special: bool) -> list[str]:
    """The incremental algorithm as first written: per token, decode the window and its
    prefix (special ids filtered out first), emit the difference unless it ends in U+FFFD."""
    special = set(tok.all_special_ids)

    def decode(ids):
        ids = [t for t in ids if not (skip_special and t in special)]
        return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    tokens = list(prompt)
    prefix_offset, read_offset = max(len(prompt) - 6, 0), len(prompt)
    pieces = []
    for t in output:
        tokens.append(t)
        prefix, full = decode(tokens[prefix_offset:read_offset]), decode(tokens[prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            pieces.append(full[len(prefix) :])
            prefix_offset, read_offset = read_offset, len(tokens)
        else:
            pieces.append("")
    return pieces


def _random_tokens(rng: random.Random, tok, n: int) -> list[int]:
    """Tokens that split multi-byte characters (byte pieces), special ids, real words."""
    words = tok(TEXT).input_ids
    pool = [
        lambda: rng.randrange(0, 300),
        lambda: rng.choice(tok.all_special_ids),
        lambda: rng.randrange(len(tok)),
        lambda: rng.choice(words),
    ]
    return [rng.choice(pool)() for _ in range(n)]


@pytest.mark.parametrize("skip_special", [True, False])
def test_fast_detokenizer_matches_the_two_window_algorithm(tok, skip_special):
    """The Detokenizer caches one token's text length and filters special ids only when a
    window holds one: same pieces as decoding both windows every time, for random streams of
    byte pieces (half characters), special tokens and words, through the backend and through
    transformers' decode, with a shared cache across sequences."""
    rng = random.Random(1)
    fast, slow = Detokenizer(tok), Detokenizer(tok, use_backend=False)
    for _ in range(60):
        prompt = _random_tokens(rng, tok, rng.randrange(0, 10))
        output = _random_tokens(rng, tok, rng.randrange(1, 40))
        want = _reference_stream(tok, prompt, output, skip_special)
        for detok in (fast, slow):
            seq = Sequence(0, list(prompt))
            got = []
            for t in output:
                seq.output_token_ids.append(t)
                got.append(detok.update(seq, skip_special))
            assert got == want
            assert seq.output_text == "".join(want)
    assert fast._one_len  # the cache was used
