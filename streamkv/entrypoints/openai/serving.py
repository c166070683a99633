"""/v1/completions and /v1/chat/completions: validated requests in, engine streams out,
OpenAI responses back — whole, or as SSE chunks (one choice per chunk, ``data: [DONE]``
last). The chat responses (tool calls included) are built in chat_serving.py; /tokenize and
/detokenize are vllm_routes.py's.

A request with several prompts (completions) or n > 1 samples interleaves its choices in
one stream; choice ``index`` = prompt_index * n + sample_index, and every choice ends with
exactly one ``finish_reason``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from streamkv.engine.async_engine import AsyncEngine, RequestStream
from streamkv.entrypoints.openai.chat_serving import ChatOutput, ChatResponder
from streamkv.entrypoints.openai.chat_template import chat_size, render_chat
from streamkv.entrypoints.openai.protocol import (
    ENGINE_ERRORS,
    TOOLS_SYSTEM_PROMPT,
    APIError,
    engine_error,
    request_failed,
    validate,
)
from streamkv.entrypoints.openai.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
)
from streamkv.entrypoints.openai.streaming import (
    DONE,
    ChoiceState,
    LogprobFormatter,
    SSEResponse,
    deltas,
    sse_event,
    tokens_out,
    usage_of,
    wait_disconnect,
    watch,
    with_usage,
)
from streamkv.sampling_params import SamplingParams
from streamkv.sequence import RequestOutput

__all__ = ["ENGINE_ERRORS", "OpenAIServing", "engine_error", "request_failed"]


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        max_queue_len: int | None = None,
        sse_keepalive: float = 15.0,
        auto_tool_choice: bool = True,
        aliases: tuple[str, ...] = (),
        tokens_as_ids: bool = False,
    ) -> None:
        self.engine, self.model_name, self.auto_tool_choice = engine, model_name, auto_tool_choice
        self.tokens_as_ids = tokens_as_ids  # --return-tokens-as-token-ids: the requests' default
        # vLLM's several --served-model-name: any may be asked for; a response names the one asked.
        self.names = {model_name, *aliases}
        self.max_queue_len, self.sse_keepalive = max_queue_len, sse_keepalive
        self.logprobs = LogprobFormatter(lambda: engine.tokenizer)

    # -- admission ------------------------------------------------------------------------
    def formatter(self, req: SamplingRequest) -> LogprobFormatter:
        asked = req.return_tokens_as_token_ids
        return self.logprobs.with_ids(self.tokens_as_ids if asked is None else asked)

    def vocab_size(self) -> int | None:
        """For vLLM's -1 ("every token") in logprob counts; None before the model is known."""
        return self.engine.info.vocab_size if self.engine.info is not None else None

    def check_model(self, model: str | None) -> None:
        if model and model not in self.names:  # "" is the default model, as in vLLM
            raise APIError(
                f"The model `{model}` does not exist.",
                404,
                "not_found_error",
                "model",
                "model_not_found",
            )

    async def start(
        self,
        base_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        renamed: dict[str, str] | None = None,
    ) -> tuple[list[RequestStream], asyncio.Event]:
        """Submit the prompts. The engine's admission (core/admission.py) refuses what could
        never run with an InvalidParameter, reported as a 400 naming the parameter as the
        request spelled it (``renamed``: "prompt" is "messages" for a chat, the engine's
        "structured_outputs" the field that asked for the constraint)."""
        notify, now = asyncio.Event(), time.monotonic()
        ids = [base_id if len(prompts) == 1 else f"{base_id}-{i}" for i in range(len(prompts))]
        # No await from the queue check to the last submit: a burst cannot all pass the check.
        self.engine.reserve(len(prompts), self.max_queue_len)
        submitted = []
        try:
            for rid, p in zip(ids, prompts, strict=True):
                submitted.append(self.engine.submit(rid, p, params, notify=notify, arrival=now))
        except BaseException as e:
            for stream, _ in submitted:
                self.engine.abort(stream.request_id)
            if isinstance(e, ValueError):  # only a client's request_id can be in use already
                raise APIError(str(e), param="request_id", code="duplicate_request_id") from None
            raise
        results = await asyncio.gather(
            *(self.engine.wait_accepted(*sub) for sub in submitted), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for r in results:
                if isinstance(r, RequestStream):
                    self.engine.abort(r.request_id)
            if isinstance(
                errors[0], ValueError
            ):  # the engine refused it (InvalidParameter names the field)
                param, message = getattr(errors[0], "param", None), str(errors[0])
                spelled = (renamed or {}).get(param, param)
                if (
                    param and spelled != param and message.startswith(param)
                ):  # name it as the request did
                    message = spelled + message[len(param) :]
                raise APIError(
                    message, param=spelled, code=getattr(errors[0], "code", None)
                ) from None
            raise errors[0]
        return results, notify

    def abort_all(self, streams: list[RequestStream]) -> None:
        for s in streams:
            if not s.finished:
                self.engine.abort(s.request_id)

    async def collect(
        self, request: Request | None, streams: list[RequestStream], notify: asyncio.Event
    ) -> list[RequestOutput] | None:
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

    def sse(self, chunks: AsyncIterator[bytes], streams: list[RequestStream]) -> SSEResponse:
        # The background task aborts even if the client left before the stream started.
        return SSEResponse(
            chunks, ping=self.sse_keepalive, background=BackgroundTask(self.abort_all, streams)
        )

    # -- /v1/completions ------------------------------------------------------------------
    async def completions(self, request: Request, body: dict) -> Response:
        req = validate(CompletionRequest, body)
        params = req.params(self.vocab_size())
        self.check_model(req.model)
        self.engine.check_alive()
        tok = self.engine.tokenizer
        texts = [p for p in req.prompt if isinstance(p, str)]
        if texts and tok is None:
            raise APIError(
                "this model has no tokenizer: send the prompt as token ids", param="prompt"
            )
        encoded = iter(
            await self.engine.run_tokenizer(
                lambda tok: [
                    tok.encode(t, add_special_tokens=req.add_special_tokens) for t in texts
                ],
                sum(map(len, texts)),
            )
            if texts
            else []
        )
        full = [next(encoded) if isinstance(p, str) else p for p in req.prompt]
        prompts = [req.truncated(p, self.engine.info.max_model_len) for p in full]
        echo = None
        if req.echo:  # a text prompt comes back as sent; token ids, or a truncated text, decoded
            as_sent = [
                isinstance(p, str) and len(ids) == len(f)
                for p, ids, f in zip(req.prompt, prompts, full)
            ]
            echo = [p if keep else "" for p, keep in zip(req.prompt, as_sent)]
            if tok is not None:
                todo = [ids for ids, keep in zip(prompts, as_sent) if not keep]
                it = iter(
                    await self.engine.run_tokenizer(
                        lambda tok: [tok.decode(ids) for ids in todo], sum(map(len, todo))
                    )
                )
                echo = [p if keep else next(it) for p, keep in zip(req.prompt, as_sent)]
        rid, created = f"cmpl-{req.request_id or uuid.uuid4().hex}", int(time.time())
        streams, notify = await self.start(rid, prompts, params, _renamed(req))
        num_prompt = sum(len(p) for p in prompts)
        head = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": req.model or self.model_name,
        }
        if req.stream:
            return self.sse(
                self._completion_stream(head, streams, notify, req, params, echo, num_prompt),
                streams,
            )
        final = await self.collect(request, streams, notify)
        if final is None:
            return Response(status_code=499)
        choices, num_out = [], 0
        for i, out in enumerate(final):
            for c in out.outputs:
                text, ids, lps, finish, stop = _returned(
                    req, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason
                )
                num_out += len(ids)
                # vLLM's choice: its optional keys null when not asked for.
                choice = {
                    "index": i * params.n + c.index,
                    "text": (echo[i] if echo else "") + text,
                    "logprobs": self._completion_lps(ChoiceState(0), req, out, ids, lps, True),
                    "finish_reason": finish,
                    "stop_reason": stop,
                    "prompt_logprobs": None
                    if req.prompt_logprobs is None
                    else self.logprobs.prompt_logprobs(out.prompt_logprobs),
                    "prompt_token_ids": out.prompt_token_ids if req.return_token_ids else None,
                    "token_ids": ids if req.return_token_ids else None,
                }
                choices.append(choice)
        choices.sort(key=lambda c: c["index"])
        return JSONResponse(
            {
                **head,
                "choices": choices,
                "usage": usage_of(num_prompt, num_out),
                "system_fingerprint": None,
                "service_tier": None,
                "kv_transfer_params": None,
            }
        )

    def _completion_lps(
        self,
        st: ChoiceState,
        req: CompletionRequest,
        out: RequestOutput,
        token_ids,
        lps,
        first: bool,
    ) -> dict | None:
        if req.logprobs is None:
            return None
        fmt = self.formatter(req)
        if req.echo and first:
            k = self.vocab_size() if req.logprobs == -1 else req.logprobs
            return fmt.echoed_logprobs(st, out, k, token_ids, lps)
        return fmt.completion_logprobs(st, token_ids, lps)

    def _completion_stream(
        self,
        head,
        streams,
        notify,
        req: CompletionRequest,
        params: SamplingParams,
        echo,
        num_prompt,
    ) -> AsyncIterator[bytes]:
        n, want_lp = params.n, req.logprobs is not None
        states = [ChoiceState(k, counted=not req.echo_only) for k in range(len(streams) * n)]

        def choices(i: int, out: RequestOutput) -> Iterator[dict]:
            for d in deltas(states, i, n, out):
                text, ids, lps, finish, stop = _returned(
                    req, d.text, d.token_ids, d.logprobs, d.finish_reason, d.stop_reason
                )
                if not text and finish is None and not want_lp:
                    continue
                first, d.choice.started = not d.choice.started, True
                choice = {
                    "index": d.choice.index,
                    "text": (echo[i] if echo and first else "") + text,
                    "logprobs": self._completion_lps(d.choice, req, out, ids, lps, first),
                    "finish_reason": finish,
                    "stop_reason": stop,
                }
                if req.return_token_ids:  # the prompt's with each choice's first chunk
                    choice.update(
                        {"prompt_token_ids": out.prompt_token_ids} if first else {}, token_ids=ids
                    )
                yield choice

        return self._stream(head, streams, notify, states, req, num_prompt, choices)

    async def _stream(
        self,
        head,
        streams,
        notify,
        states,
        req: SamplingRequest,
        num_prompt,
        choices: Callable[[int, RequestOutput], Iterator[dict]],
        opening: list[dict] | None = None,
        opening_head: dict | None = None,
    ) -> AsyncIterator[bytes]:
        """SSE framing shared by completions and chat: the ``opening`` chunks (with the
        fields of ``opening_head`` beside the id), then one chunk
        per choice that ``choices(request index, output)`` makes of each engine output (all
        of one output sent at once); an error event if a request fails; the usage chunk when
        the client asked for it; the requests aborted however the stream ends; ``[DONE]``."""

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
            self.abort_all(streams)
        yield DONE

    # -- /v1/chat/completions -------------------------------------------------------------
    async def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        self.check_model(req.model)
        self.engine.check_alive()
        tok = self.engine.tokenizer
        if tok is None:
            raise APIError("this model has no tokenizer, so no chat template", param="messages")
        if (
            req.tool_mode() == "auto" and not self.auto_tool_choice
        ):  # vLLM's answer without the flag
            raise APIError(
                '"auto" tool choice needs --enable-auto-tool-choice (this server runs with '
                "--no-enable-auto-tool-choice)",
                param="tool_choice",
            )
        tools = req.tools if req.tool_mode() != "none" else None
        tools_prompt = TOOLS_SYSTEM_PROMPT.get()  # read here: the tokenizer thread has no context
        ids = await self.engine.run_tokenizer(
            lambda tok: render_chat(
                tok,
                req.messages,
                req.add_generation_prompt,
                req.add_special_tokens,
                tools,
                req.chat_template_kwargs,
                req.continue_final_message,
                tools_prompt,
            ),
            chat_size(req.messages, tools),
        )
        return req.truncated(ids, self.engine.info.max_model_len)

    async def chat(self, request: Request, body: dict) -> Response:
        req = validate(ChatCompletionRequest, body)
        if not req.stream:
            out = await self.chat_whole(request, req)
            return Response(status_code=499) if out is None else JSONResponse(out)
        params = req.params(self.vocab_size())
        ids = await self.chat_prompt(req)
        rid, created = f"chatcmpl-{req.request_id or uuid.uuid4().hex}", int(time.time())
        streams, notify = await self.start(
            rid, [ids], params, {"prompt": "messages", "logprobs": "top_logprobs", **_renamed(req)}
        )
        head = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": req.model or self.model_name,
        }
        responder = ChatResponder(
            req, self.formatter(req), params.logprobs if req.logprobs else None
        )
        states = [ChoiceState(k) for k in range(params.n)]
        extra = {"prompt_token_ids": ids} if req.return_token_ids else None
        return self.sse(
            self._stream(
                head,
                streams,
                notify,
                states,
                req,
                len(ids),
                responder.stream_choices(states),
                responder.opening(states),
                extra,
            ),
            streams,
        )

    async def chat_whole(self, request: Request | None, req: ChatCompletionRequest) -> dict | None:
        """A chat completion answered whole; None if the client went away first."""
        params = req.params(self.vocab_size())
        ids = await self.chat_prompt(req)
        rid, created = f"chatcmpl-{req.request_id or uuid.uuid4().hex}", int(time.time())
        streams, notify = await self.start(
            rid, [ids], params, {"prompt": "messages", "logprobs": "top_logprobs", **_renamed(req)}
        )
        final = await self.collect(request, streams, notify)
        if final is None:
            return None
        responder = ChatResponder(
            req, self.formatter(req), params.logprobs if req.logprobs else None
        )
        out: ChatOutput = responder.whole(final[0])
        # vLLM's response: its optional keys null when not asked for.
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": req.model or self.model_name,
            "choices": out.choices,
            "usage": usage_of(len(ids), out.num_tokens),
            "system_fingerprint": None,
            "service_tier": None,
            "prompt_logprobs": None
            if req.prompt_logprobs is None
            else self.logprobs.prompt_logprobs(final[0].prompt_logprobs),
            "prompt_token_ids": ids if req.return_token_ids else None,
            "kv_transfer_params": None,
        }


def _returned(req: CompletionRequest, text: str, ids: list[int], lps, finish: str | None, stop):
    """A choice's output as returned: all of it, or for an echo-only request only its end."""
    if not req.echo_only:
        return text, ids, lps, finish, stop
    return "", [], [] if lps is not None else None, "length" if finish is not None else None, None


def _renamed(req: SamplingRequest) -> dict[str, str]:
    """The engine's ``structured_outputs`` refusals, under the field the request used."""
    source = req.constraint_source()
    return {"structured_outputs": source} if source else {}
