"""Incremental detokenization: text grows token by token without ever emitting half a
UTF-8 character, and stop strings are found and trimmed; with them, the other conditions
that end a sequence on its newest token (EOS, stop ids, length: ``check_stop_conditions``).

Decoding a window of a few previous tokens together with the new ones (rather than the new
token alone) keeps tokenizers that merge spaces or byte pieces correct; a window that ends in
U+FFFD is an incomplete character and waits for the next token.
"""

from __future__ import annotations

from functools import partial

from streamkv.sampling_params import SamplingParams
from streamkv.sequence import Sequence, SequenceStatus

_WINDOW = 6
EXACT_HOLDBACK_CHARS = 64  # longer stop strings hold back their length - 1 (see holdback)


class Detokenizer:
    def __init__(self, tokenizer, use_backend: bool = True) -> None:
        """``use_backend=False`` decodes through transformers' wrapper even for a fast
        tokenizer (tests compare the two)."""
        self.tokenizer = tokenizer
        self._special = frozenset(getattr(tokenizer, "all_special_ids", []) or [])
        # A fast tokenizer's Rust backend decodes a window in ~1 µs; the Python wrapper
        # around it costs several µs more per call (argument conversion, clean-up checks),
        # which is most of the engine's per-token time. Same text, since clean-up is off.
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - transformers depends on tokenizers
            Tokenizer = None  # noqa: N806
        backend = getattr(tokenizer, "_tokenizer", None)
        fast = use_backend and Tokenizer is not None and isinstance(backend, Tokenizer)
        self.uses_backend = fast
        # ids -> text, the backend's or transformers' (one C call per window on the fast path).
        self._decode = (
            partial(backend.decode, skip_special_tokens=False)
            if fast
            else partial(
                tokenizer.decode, skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        )
        # The length of one token's text decoded alone, by token id. Once a sequence's text
        # flows, each update's prefix window is the one token emitted the update before, so
        # this halves the decodes per token. Exact: decoding is a function of the ids. At
        # most one entry per vocabulary id.
        self._one_len: dict[int, int] = {}

    def update(self, seq: Sequence, skip_special: bool = True) -> str:
        """Append the text of ``seq``'s newest tokens to ``seq.output_text``; return it.

        The new text is the window's text past its prefix's (the tokens already emitted
        since ``prefix_offset``): ``decode(window)[len(decode(window[:read - prefix])):]``.
        """
        prompt, out = seq.prompt_token_ids, seq.output_token_ids
        n_prompt = len(prompt)
        start = seq.prefix_offset
        if start < 0:
            # Start the window inside the prompt so the first output token decodes in context.
            start = seq.prefix_offset = max(n_prompt - _WINDOW, 0)
            seq.read_offset = n_prompt
        # The window, not a copy of the sequence.
        window = out[start - n_prompt :] if start >= n_prompt else prompt[start:] + out
        split = seq.read_offset - start
        special, decode = self._special, self._decode
        if skip_special and special and not special.isdisjoint(window):
            head = [t for t in window[:split] if t not in special]
            window = head + [t for t in window[split:] if t not in special]
            split = len(head)
        if split == 1:
            token = window[0]
            prefix_len = self._one_len.get(token)
            if prefix_len is None:
                prefix_len = self._one_len[token] = len(decode(window[:1]))
        else:
            prefix_len = len(decode(window[:split]))
        full = decode(window)
        if len(full) > prefix_len and not full.endswith("\ufffd"):
            new = full[prefix_len:]
            seq.output_text += new
            seq.prefix_offset = seq.read_offset
            seq.read_offset = n_prompt + len(out)
            return new
        return ""


def check_stop_conditions(
    seq: Sequence,
    params: SamplingParams,
    old_len: int,
    eos_token_ids: frozenset[int],
    max_model_len: int,
) -> None:
    """Whether ``seq``'s newest token ends it, after its grammar's verdict: EOS, stop ids,
    stop strings (in the text past ``old_len``; a hit is trimmed), then length."""
    out_ids = seq.output_token_ids
    token = out_ids[-1]
    n_out = len(out_ids)
    if n_out >= params.min_tokens:
        if not params.ignore_eos and token in eos_token_ids:
            seq.status = SequenceStatus.FINISHED_STOPPED
            return
        if params.stop_token_ids and token in params.stop_token_ids:
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
            return
        if params.stop:
            hit = find_stop(seq.output_text, params.stop, old_len)
            if hit is not None:
                i, stop = hit
                seq.output_text = seq.output_text[
                    : i + len(stop) if params.include_stop_str_in_output else i
                ]
                seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
                return
    max_tokens = params.max_tokens
    if max_tokens is not None and n_out >= max_tokens:
        seq.status = SequenceStatus.FINISHED_LENGTH
    elif n_out + len(seq.prompt_token_ids) >= max_model_len:
        seq.status = SequenceStatus.FINISHED_LENGTH


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
