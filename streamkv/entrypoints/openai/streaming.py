"""The plumbing between engine streams and SSE responses: per-choice deltas from cumulative
outputs, a wait over several streams at once, and the OpenAI logprobs formats.

SSE goes out through sse-starlette's ``EventSourceResponse`` (its keep-alive pings, its
disconnect watch, its shutdown signal), one send per request per engine step: all the events
one engine output makes (every choice's chunk, the usage chunk) are joined into one body.
Events are encoded with msgspec, not ``json``: under a burst the event loop formats and sends
one event per running request per step, and its share of the one GIL is taken from the
engine thread (docs/benchmarks.md "Where the served time goes").
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec
from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request

from streamkv.engine.async_engine import RequestStream
from streamkv.sequence import Logprob, RequestOutput

DONE = b"data: [DONE]\n\n"


_encode = msgspec.json.Encoder().encode


def sse_event(obj: dict) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


class SSEResponse(EventSourceResponse):
    """sse-starlette's response without its per-send cancel scope when no send timeout is
    set (the server sets none): the scope cost more than the send it guarded under a burst
    (py-spy, docs/benchmarks.md). With ``send_timeout`` set it is the library's own send."""

    async def _send_with_timeout(self, send, message) -> None:
        if self.send_timeout is not None:
            return await super()._send_with_timeout(send, message)
        try:
            await send(message)
        except BaseException:
            self._send_interrupted = True
            raise


def usage_of(num_prompt: int, num_out: int) -> dict:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_out,
        "total_tokens": num_prompt + num_out,
    }


def tokens_out(states: list[ChoiceState]) -> int:
    return sum(st.num_tokens for st in states if st.counted)


def with_usage(
    chunk: dict, include: bool, continuous: bool, num_prompt: int, states: list[ChoiceState]
) -> dict:
    """A stream chunk's ``usage``: null on every chunk with ``include_usage``, the running
    count with ``continuous_usage_stats`` (vLLM)."""
    if include:
        chunk["usage"] = usage_of(num_prompt, tokens_out(states)) if continuous else None
    return chunk


@dataclass(slots=True)
class ChoiceState:
    index: int
    text_len: int = 0
    num_tokens: int = 0
    text_offset: int = 0
    started: bool = False
    done: bool = False
    counted: bool = (
        True  # its tokens count as completion tokens (not those of an echo-only request)
    )


@dataclass(slots=True)
class Delta:
    choice: ChoiceState
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


def deltas(states: list[ChoiceState], prompt_index: int, n: int, out: RequestOutput):
    """What each choice of ``out`` added since the last call (outputs are cumulative)."""
    for c in out.outputs:
        st = states[prompt_index * n + c.index]
        if st.done:
            continue
        text, ids = c.text[st.text_len :], c.token_ids[st.num_tokens :]
        if not text and not ids and c.finish_reason is None:
            continue
        lps = c.logprobs[st.num_tokens :] if c.logprobs is not None else None
        st.text_len, st.num_tokens, st.done = (
            len(c.text),
            len(c.token_ids),
            c.finish_reason is not None,
        )
        yield Delta(st, text, ids, lps, c.finish_reason, c.stop_reason)


async def watch(
    streams: list[RequestStream], notify: asyncio.Event
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, newest output) from several streams sharing one ``notify`` event."""
    pending = list(range(len(streams)))
    while pending:
        progressed = False
        for i in list(pending):
            out = streams[i].take()
            if out is not None:
                progressed = True
                yield i, out
                if out.finished:
                    pending.remove(i)
        if pending and not progressed:
            notify.clear()
            await notify.wait()


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
