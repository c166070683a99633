"""/v1/completions and /v1/chat/completions: validated requests in, engine streams out,
OpenAI responses back — whole, or as SSE chunks (one choice per chunk, ``data: [DONE]`` last).

A request with several prompts (completions) or n > 1 samples interleaves its choices in
one stream; choice ``index`` = prompt_index * n + sample_index, and every choice ends with
exactly one ``finish_reason``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator

from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from streamkv.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineNotReadyError,
    EngineRecoveringError,
    EngineStoppingError,
    QueueFullError,
    RequestAbortedError,
    RequestStream,
)
from streamkv.engine.recovery import EngineRestartedError
from streamkv.engine.tokenizer_lanes import TokenizerBusyError
from streamkv.entrypoints.openai_protocol import (
    APIError,
    ChatRequest,
    StreamOptions,
    parse_chat,
    parse_completion,
)
from streamkv.entrypoints.streaming import (
    DONE,
    ChoiceState,
    EventStream,
    LogprobFormatter,
    deltas,
    sse_event,
    wait_disconnect,
    watch,
)
from streamkv.sampling_params import SamplingParams
from streamkv.sequence import RequestOutput


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, max_queue_len: int | None = None,
                 sse_keepalive: float = 15.0) -> None:
        self.engine, self.model_name = engine, model_name
        self.max_queue_len, self.sse_keepalive = max_queue_len, sse_keepalive
        self.logprobs = LogprobFormatter(lambda: engine.tokenizer)

    # -- admission ------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(f"The model `{model}` does not exist.", 404, "not_found_error", "model", "model_not_found")

    async def start(self, base_id: str, prompts: list[list[int]], params: SamplingParams,
                    prompt_param: str = "prompt") -> tuple[list[RequestStream], asyncio.Event]:
        """Submit the prompts. The engine's admission (core/admission.py) refuses what could
        never run with an InvalidParameter, reported as a 400 naming the parameter
        (``prompt_param`` for the prompt itself: "messages" for a chat)."""
        notify, now = asyncio.Event(), time.monotonic()
        ids = [base_id if len(prompts) == 1 else f"{base_id}-{i}" for i in range(len(prompts))]
        # No await from the queue check to the last submit: a burst cannot all pass the check.
        self.engine.reserve(len(prompts), self.max_queue_len)
        submitted = []
        try:
            for rid, p in zip(ids, prompts, strict=True):
                submitted.append(self.engine.submit(rid, p, params, notify=notify, arrival=now))
        except BaseException:
            for stream, _ in submitted:
                self.engine.abort(stream.request_id)
            raise
        results = await asyncio.gather(*(self.engine.wait_accepted(*sub) for sub in submitted), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for r in results:
                if isinstance(r, RequestStream):
                    self.engine.abort(r.request_id)
            if isinstance(errors[0], ValueError):  # the engine refused it (InvalidParameter names the field)
                param = getattr(errors[0], "param", None)
                raise APIError(str(errors[0]), param=prompt_param if param == "prompt" else param,
                               code=getattr(errors[0], "code", None)) from None
            raise errors[0]
        return results, notify

    def abort_all(self, streams: list[RequestStream]) -> None:
        for s in streams:
            if not s.finished:
                self.engine.abort(s.request_id)

    async def collect(self, request: Request | None, streams: list[RequestStream], notify: asyncio.Event) -> list[RequestOutput] | None:
        """Final outputs; None if the client went away first (its requests are aborted)."""
        final: list[RequestOutput | None] = [None] * len(streams)

        async def gather() -> None:
            async for i, out in watch(streams, notify):
                final[i] = out

        work = asyncio.ensure_future(gather())
        tasks = {work}
        if request is not None:
            tasks.add(asyncio.ensure_future(wait_disconnect(request)))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                return None
            work.result()
        finally:
            for t in tasks:
                t.cancel()
            self.abort_all(streams)
        for out in final:
            if out.error:
                raise request_failed(out.error)
        return final

    def sse(self, chunks: AsyncIterator[bytes], streams: list[RequestStream]) -> EventSourceResponse:
        # The background task aborts even if the client left before the stream started.
        return EventStream(chunks, ping=self.sse_keepalive,
                                   background=BackgroundTask(self.abort_all, streams))

    # -- /v1/completions ------------------------------------------------------------------
    async def completions(self, request: Request, body: dict) -> Response:
        req = parse_completion(body)
        self.check_model(req.model)
        self.engine.check_alive()
        tok = self.engine.tokenizer
        texts = [p for p in req.prompts if isinstance(p, str)]
        if texts and tok is None:
            raise APIError("this model has no tokenizer: send the prompt as token ids", param="prompt")
        encoded = iter(await self.engine.run_tokenizer(
            lambda tok: [tok.encode(t, add_special_tokens=req.add_special_tokens) for t in texts],
            sum(map(len, texts))) if texts else [])
        prompts = [next(encoded) if isinstance(p, str) else p for p in req.prompts]
        echo = None
        if req.echo:
            echo = [p if isinstance(p, str) else "" for p in req.prompts]
            if tok is not None:
                id_prompts = [p for p in req.prompts if not isinstance(p, str)]
                decoded = await self.engine.run_tokenizer(lambda tok: [tok.decode(p) for p in id_prompts],
                                                          sum(map(len, id_prompts)))
                it = iter(decoded)
                echo = [p if isinstance(p, str) else next(it) for p in req.prompts]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        streams, notify = await self.start(rid, prompts, req.params)
        n, want_lp = req.params.n, req.params.logprobs is not None
        num_prompt = sum(len(p) for p in prompts)
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}
        if req.stream.stream:
            return self.sse(self._completion_stream(head, streams, notify, n, echo, want_lp, req.stream, num_prompt), streams)
        final = await self.collect(request, streams, notify)
        if final is None:
            return Response(status_code=499)
        choices, num_out = [], 0
        for i, out in enumerate(final):
            for c in out.outputs:
                num_out += len(c.token_ids)
                lp = self.logprobs.completion_logprobs(ChoiceState(0), c.token_ids, c.logprobs) if want_lp else None
                choices.append({"index": i * n + c.index, "text": (echo[i] if echo else "") + c.text,
                                "logprobs": lp, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        choices.sort(key=lambda c: c["index"])
        return JSONResponse({**head, "choices": choices, "usage": _usage(num_prompt, num_out)})

    def _completion_stream(self, head, streams, notify, n, echo, want_lp, opts: StreamOptions, num_prompt) -> AsyncIterator[bytes]:
        states = [ChoiceState(k) for k in range(len(streams) * n)]

        def choices(i: int, out) -> Iterator[dict]:
            for d in deltas(states, i, n, out):
                if not d.text and d.finish_reason is None and not want_lp:
                    continue
                text = d.text
                if echo and not d.choice.started:
                    text = echo[i] + text
                d.choice.started = True
                yield {"index": d.choice.index, "text": text,
                       "logprobs": self.logprobs.completion_logprobs(d.choice, d.token_ids, d.logprobs) if want_lp else None,
                       "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}

        return self._stream(head, streams, notify, states, opts, num_prompt, choices)

    async def _stream(self, head, streams, notify, states, opts: StreamOptions, num_prompt,
                      choices: Callable[[int, object], Iterator[dict]], opening: Iterable[dict] = ()) -> AsyncIterator[bytes]:
        """SSE framing shared by completions and chat: the ``opening`` chunks, then one chunk
        per choice that ``choices(request index, output)`` makes of each engine output; an
        error event if a request fails; the usage chunk when the client asked for it; the
        requests aborted however the stream ends; ``[DONE]`` last."""
        try:
            for choice in opening:
                yield sse_event(_with_usage({**head, "choices": [choice]}, opts, num_prompt, states))
            async for i, out in watch(streams, notify):
                if out.error:
                    yield sse_event(request_failed(out.error).body())
                    break
                for choice in choices(i, out):
                    yield sse_event(_with_usage({**head, "choices": [choice]}, opts, num_prompt, states))
            else:
                if opts.include_usage:
                    yield sse_event({**head, "choices": [], "usage": _usage(num_prompt, _num_out(states))})
        except ENGINE_ERRORS as e:
            yield sse_event(engine_error(e).body())
        finally:
            self.abort_all(streams)
        yield DONE

    # -- /v1/chat/completions -------------------------------------------------------------
    async def chat_prompt(self, req: ChatRequest) -> list[int]:
        self.check_model(req.model)
        self.engine.check_alive()
        tok = self.engine.tokenizer
        if tok is None:
            raise APIError("this model has no tokenizer, so no chat template", param="messages")
        ids = await self.engine.run_tokenizer(
            lambda tok: render_chat(tok, req.messages, req.add_generation_prompt, req.add_special_tokens),
            chat_size(req.messages))
        return ids

    async def chat(self, request: Request, body: dict) -> Response:
        req = parse_chat(body)
        ids = await self.chat_prompt(req)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        streams, notify = await self.start(rid, [ids], req.params, prompt_param="messages")
        head = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name}
        top = req.params.logprobs if req.logprobs else None
        if req.stream.stream:
            head["object"] = "chat.completion.chunk"
            return self.sse(self._chat_stream(head, streams, notify, req.params.n, top, req.stream, len(ids)), streams)
        final = await self.collect(request, streams, notify)
        if final is None:
            return Response(status_code=499)
        choices = [
            {"index": c.index, "message": {"role": "assistant", "content": c.text},
             "logprobs": self.logprobs.chat_logprobs(c.token_ids, c.logprobs, top) if top is not None else None,
             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            for c in final[0].outputs
        ]
        num_out = sum(len(c.token_ids) for c in final[0].outputs)
        return JSONResponse({**head, "choices": choices, "usage": _usage(len(ids), num_out)})

    def _chat_stream(self, head, streams, notify, n, top, opts: StreamOptions, num_prompt) -> AsyncIterator[bytes]:
        states = [ChoiceState(k) for k in range(n)]
        opening = [{"index": st.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                   for st in states]

        def choices(_: int, out) -> Iterator[dict]:
            for d in deltas(states, 0, n, out):
                if not d.text and d.finish_reason is None and top is None:
                    continue
                choice = {"index": d.choice.index, "delta": {"content": d.text} if d.text else {},
                          "logprobs": self.logprobs.chat_logprobs(d.token_ids, d.logprobs, top) if top is not None else None,
                          "finish_reason": d.finish_reason}
                if d.finish_reason is not None:
                    choice["stop_reason"] = d.stop_reason
                yield choice

        return self._stream(head, streams, notify, states, opts, num_prompt, choices, opening)


def render_chat(tok, messages: list[dict], add_generation_prompt: bool, add_special_tokens: bool) -> list[int]:
    """Runs on the tokenizer thread: a long conversation never blocks the event loop."""
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja2 errors, templates that raise on bad role order, ...
        raise APIError(f"the chat template rejected the messages: {e}", param="messages") from None
    return tok.encode(text, add_special_tokens=add_special_tokens)


def _usage(num_prompt: int, num_out: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_out, "total_tokens": num_prompt + num_out}


def _num_out(states: list[ChoiceState]) -> int:
    return sum(st.num_tokens for st in states)


def _with_usage(chunk: dict, opts: StreamOptions, num_prompt: int, states: list[ChoiceState]) -> dict:
    if opts.include_usage:
        chunk["usage"] = _usage(num_prompt, _num_out(states)) if opts.continuous_usage else None
    return chunk


def chat_size(messages: list[dict]) -> int:
    """Characters a chat template will see, for picking the tokenizer lane."""
    return sum(len(m.get("content") or "") + 16 for m in messages)


# Every way the engine can refuse or drop a request, mapped once (engine_error) so that
# HTTP, SSE and the WebSocket report the same status and ``code`` for the same failure.
ENGINE_ERRORS = (EngineDeadError, EngineNotReadyError, EngineRecoveringError, EngineRestartedError,
                 EngineStoppingError, QueueFullError, RequestAbortedError, TokenizerBusyError)


def engine_error(e: BaseException) -> APIError:
    if isinstance(e, QueueFullError):
        return APIError("the server's request queue is full; retry later", 429, "rate_limit_error",
                        code="queue_full", headers={"retry-after": "1"})
    if isinstance(e, TokenizerBusyError):
        return APIError(str(e), 429, "rate_limit_error", code="tokenizer_busy", headers={"retry-after": "1"})
    if isinstance(e, EngineRecoveringError):
        return APIError(str(e), 503, "service_unavailable_error", code="engine_recovering", headers={"retry-after": "5"})
    code = {EngineDeadError: "engine_dead", EngineNotReadyError: "engine_loading",
            EngineRestartedError: "engine_restarted", EngineStoppingError: "server_shutting_down",
            RequestAbortedError: "request_aborted"}[type(e)]
    message = "the request was aborted" if isinstance(e, RequestAbortedError) else str(e)
    return APIError(message, 503, "service_unavailable_error", code=code)


def request_failed(error: str) -> APIError:
    """A request the engine took but could not finish (the KV cache is too small for it, or
    its step failed): the other requests go on."""
    return APIError(f"the engine could not finish the request: {error}", 503, "service_unavailable_error",
                    code="engine_error")

