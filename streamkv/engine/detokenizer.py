"""Incremental detokenization: text grows token by token without ever emitting half a
UTF-8 character, and stop strings are found and trimmed.

Decoding a window of a few previous tokens together with the new ones (rather than the new
token alone) keeps tokenizers that merge spaces or byte pieces correct; a window that ends in
U+FFFD is an incomplete character and waits for the next token.
"""

from __future__ import annotations

from streamkv.sequence import Sequence

_WINDOW = 6
EXACT_HOLDBACK_CHARS = 64  # longer stop strings hold back their length - 1 (see holdback)


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        # A fast tokenizer's Rust backend decodes a window in ~1 µs; the Python wrapper
        # around it costs several µs more per call (argument conversion, clean-up checks),
        # which is most of the engine's per-token time. Same text, since clean-up is off.
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - transformers depends on tokenizers
            Tokenizer = None  # noqa: N806
        backend = getattr(tokenizer, "_tokenizer", None)
        fast = Tokenizer is not None and isinstance(backend, Tokenizer)
        self._backend_decode = backend.decode if fast else None

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        if skip_special and self._special:
            ids = [t for t in ids if t not in self._special]
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def update(self, seq: Sequence, skip_special: bool = True) -> str:
        """Append the text of ``seq``'s newest tokens to ``seq.output_text``; return it."""
        n_prompt = len(seq.prompt_token_ids)
        if seq.prefix_offset < 0:
            # Start the window inside the prompt so the first output token decodes in context.
            seq.prefix_offset = max(n_prompt - _WINDOW, 0)
            seq.read_offset = n_prompt
        window = seq.token_window(seq.prefix_offset)  # the window, not a copy of the sequence
        prefix = self._decode(window[: seq.read_offset - seq.prefix_offset], skip_special)
        full = self._decode(window, skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            seq.output_text += new
            seq.prefix_offset = seq.read_offset
            seq.read_offset = n_prompt + len(seq.output_token_ids)
            return new
        return ""


def find_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    """Earliest stop string that ends at or after ``start``: (index where it begins, stop)."""
    best = None
    for stop in stops:
        i = text.find(stop, max(0, start - len(stop) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best


def holdback(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` that could begin a stop string (not yet emitted).

    For a stop string of at most ``EXACT_HOLDBACK_CHARS`` characters: the longest
    ``k < len(stop)`` such that ``text`` ends with ``stop[:k]``; only a ``k`` whose
    ``stop[k - 1]`` is the text's last character can match, and ``str.rfind`` finds those
    in C. A longer stop string always holds back ``len(stop) - 1`` characters, as vLLM does
    for every stop string: the exact search costs O(len(stop)^2) on a periodic string, and
    trying every ``k`` with a slice of the text each took 0.23 s per sequence per step for
    32 stops of 60 KB (issue 13), on the engine thread, stalling every request. So the cost
    per new token is O(len(stops) * EXACT_HOLDBACK_CHARS^2) at worst, whatever the lengths of
    the text and of the stop strings. Both rules keep the emitted text growing: the hold-back
    grows by at most the characters added since the last call.
    """
    n = len(text)
    if not n:
        return 0
    last, keep = text[-1], 0
    for stop in stops:
        end = min(len(stop) - 1, n)  # candidates: keep < k <= end
        if len(stop) > EXACT_HOLDBACK_CHARS:
            keep = max(keep, end)
            continue
        while end > keep:
            p = stop.rfind(last, keep, end)
            if p < 0:
                break
            k = p + 1
            if text[n - k] == stop[0] and text.endswith(stop[:k]):
                keep = k
                break
            end = p
    return keep
