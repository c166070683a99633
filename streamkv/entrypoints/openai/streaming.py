"""The plumbing between engine streams and SSE responses: per-choice deltas from cumulative
outputs, a wait over several streams at once, and the chunk framing both generation
endpoints share (logprobs are logprobs.py's).

SSE goes out through sse-starlette's ``EventSourceResponse`` (its keep-alive pings, its
disconnect watch, its shutdown signal), one send per request per engine step: all the events
one engine output makes (every choice's chunk, the usage chunk) are joined into one body.
Events are encoded with msgspec, not ``json``: under a burst the event loop formats and sends
one event per running request per step, and its share of the one GIL is taken from the
engine thread (docs/benchmarks.md "Where the served time goes").
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request

from streamkv.engine.request_book import RequestStream
from streamkv.entrypoints.openai.errors import ENGINE_ERRORS, engine_error, request_failed
from streamkv.sequence import Logprob, RequestOutput

if TYPE_CHECKING:
    from streamkv.entrypoints.openai.requests import SamplingRequest

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
    # Its tokens count as completion tokens (not those of an echo-only request).
    counted: bool = True


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


async def sse_chunks(
    head: dict,
    streams: list[RequestStream],
    notify: asyncio.Event,
    states: list[ChoiceState],
    req: SamplingRequest,
    num_prompt: int,
    choices: Callable[[int, RequestOutput], Iterator[dict]],
    abort_all: Callable[[list[RequestStream]], None],
    opening: list[dict] | None = None,
    opening_head: dict | None = None,
) -> AsyncIterator[bytes]:
    """The SSE body of a streamed completion or chat: the ``opening`` chunks (with the fields
    of ``opening_head`` beside the id), then one chunk per choice that ``choices(request
    index, output)`` makes of each engine output (all of one output sent at once); an error
    event if a request fails; the usage chunk when the client asked for it; the requests
    aborted however the stream ends; ``[DONE]``."""

    def frame(choice: dict, top: dict = head) -> bytes:
        chunk = {**top, "choices": [choice]}
        return sse_event(
            with_usage(chunk, req.include_usage, req.continuous_usage, num_prompt, states)
        )

    try:
        if opening:
            top = {**head, **(opening_head or {})}
            yield b"".join(frame(c, top) for c in opening)
        async for i, out in watch(streams, notify):
            if out.error:
                yield sse_event(request_failed(out.error).body())
                break
            events = [frame(c) for c in choices(i, out)]
            if events:
                yield b"".join(events)
        else:
            if req.include_usage:
                yield sse_event(
                    {**head, "choices": [], "usage": usage_of(num_prompt, tokens_out(states))}
                )
    except ENGINE_ERRORS as e:
        yield sse_event(engine_error(e).body())
    finally:
        abort_all(streams)
    yield DONE
