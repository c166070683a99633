"""Incremental detokenization: text grows token by token without ever emitting half a
UTF-8 character, and stop strings are found and trimmed.

Decoding a window of a few previous tokens together with the new ones (rather than the new
token alone) keeps tokenizers that merge spaces or byte pieces correct; a window that ends in
U+FFFD is an incomplete character and waits for the next token.
"""

from __future__ import annotations

from streamkv.sequence import Sequence

_WINDOW = 6


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        if skip_special and self._special:
            ids = [t for t in ids if t not in self._special]
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def update(self, seq: Sequence, skip_special: bool = True) -> str:
        """Append the text of ``seq``'s newest tokens to ``seq.output_text``; return it."""
        tokens = seq.all_token_ids
        if seq.prefix_offset < 0:
            # Start the window inside the prompt so the first output token decodes in context.
            n = len(seq.prompt_token_ids)
            seq.prefix_offset = max(n - _WINDOW, 0)
            seq.read_offset = n
        prefix = self._decode(tokens[seq.prefix_offset : seq.read_offset], skip_special)
        full = self._decode(tokens[seq.prefix_offset :], skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            seq.output_text += new
            seq.prefix_offset = seq.read_offset
            seq.read_offset = len(tokens)
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
    """Characters at the end of ``text`` that could begin a stop string (not yet emitted)."""
    keep = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if stop.startswith(text[-k:]):
                keep = max(keep, k)
                break
    return keep
