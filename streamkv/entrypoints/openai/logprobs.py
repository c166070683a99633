"""OpenAI's logprobs shapes: the legacy completion one (with echo's prompt scoring), the
chat one, and vLLM's ``prompt_logprobs``. Formatted only for a request that asks for them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from streamkv.entrypoints.openai.streaming import ChoiceState
from streamkv.sequence import Logprob, RequestOutput


def clamp(lp: float) -> float:
    return max(lp, -9999.0) if not math.isnan(lp) else -9999.0


class LogprobFormatter:
    """OpenAI's two logprobs shapes; token texts are decoded once per token id and cached."""

    def __init__(
        self,
        tokenizer: Callable[[], object],
        as_ids: bool = False,
        cache: dict[int, str] | None = None,
    ) -> None:
        self.tokenizer, self.as_ids = tokenizer, as_ids
        self._token_text: dict[int, str] = {} if cache is None else cache

    def with_ids(self, as_ids: bool) -> LogprobFormatter:
        """This formatter, or one that names tokens ``token_id:ID`` (vLLM's
        ``return_tokens_as_token_ids``: a token that is not whole UTF-8 text stays exact)."""
        return (
            LogprobFormatter(self.tokenizer, True, self._token_text)
            if as_ids and not self.as_ids
            else self
        )

    def token_text(self, tid: int) -> str:
        if self.as_ids:
            return f"token_id:{tid}"
        text = self._token_text.get(tid)
        if text is None:
            tok = self.tokenizer()
            text = tok.decode([tid]) if tok is not None else ""
            self._token_text[tid] = text
        return text

    def completion_logprobs(
        self,
        st: ChoiceState,
        token_ids: list[int],
        lps: list[dict[int, Logprob] | None],
        k: int | None = None,
    ) -> dict:
        """OpenAI's legacy shape. An entry of None (the prompt's first token) has no logprob;
        ``k`` keeps the top k of each entry (and the token itself)."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, d in zip(token_ids, lps, strict=True):
            text = self.token_text(tid)
            tokens.append(text)
            offsets.append(st.text_offset)
            st.text_offset += len(text)
            if d is None:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(clamp(d[tid].logprob) if tid in d else None)
            tops.append(
                {
                    self.token_text(t): clamp(lp.logprob)
                    for t, lp in d.items()
                    if k is None or t == tid or lp.rank is None or lp.rank <= k
                }
            )
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def echoed_logprobs(
        self,
        st: ChoiceState,
        out: RequestOutput,
        k: int,
        token_ids: list[int],
        lps: list[dict[int, Logprob]],
    ) -> dict:
        """The prompt's tokens and logprobs (the first one null), then the completion's."""
        prompt = out.prompt_token_ids
        head = self.completion_logprobs(st, prompt, out.prompt_logprobs or [None] * len(prompt), k)
        tail = self.completion_logprobs(st, token_ids, lps)
        return {key: head[key] + tail[key] for key in head}

    def prompt_logprobs(
        self, lps: list[dict[int, Logprob] | None] | None
    ) -> list[dict | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt token, ``{"token id": {logprob, rank,
        decoded_token}}`` (None for the first token)."""
        if lps is None:
            return None
        return [
            None
            if d is None
            else {
                str(t): {
                    "logprob": clamp(lp.logprob),
                    "rank": lp.rank,
                    "decoded_token": self.token_text(t),
                }
                for t, lp in d.items()
            }
            for d in lps
        ]

    def chat_logprobs(self, token_ids: list[int], lps: list[dict[int, Logprob]], k: int) -> dict:
        def entry(tid: int, lp: float) -> dict:
            text = self.token_text(tid)
            return {"token": text, "logprob": clamp(lp), "bytes": list(text.encode())}

        content = []
        for tid, d in zip(token_ids, lps, strict=True):
            ranked = sorted((lp.rank, t, lp.logprob) for t, lp in d.items() if lp.rank is not None)[
                :k
            ]
            content.append(
                {
                    **entry(tid, d[tid].logprob),
                    "top_logprobs": [entry(t, lp) for _, t, lp in ranked],
                }
            )
        return {"content": content}
