"""/v1/completions, and what both generation endpoints share: admission, collection of a
whole answer, and the SSE framing of a streamed one (one choice per chunk, ``data: [DONE]``
last). The chat endpoint is chat_serving.py's; /tokenize and /detokenize are vllm_routes.py's.

A request with several prompts (completions) or n > 1 samples interleaves its choices in
one stream; choice ``index`` = prompt_index * n + sample_index, and every choice ends with
exactly one ``finish_reason``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from streamkv.engine.async_engine import AsyncEngine
from streamkv.engine.request_book import RequestStream
from streamkv.entrypoints.openai.errors import APIError, request_failed
from streamkv.entrypoints.openai.logprobs import LogprobFormatter
from streamkv.entrypoints.openai.protocol import validate
from streamkv.entrypoints.openai.requests import CompletionRequest, SamplingRequest
from streamkv.entrypoints.openai.streaming import (
    ChoiceState,
    SSEResponse,
    deltas,
    sse_chunks,
    usage_of,
    wait_disconnect,
    watch,
)
from streamkv.sampling_params import SamplingParams
from streamkv.sequence import RequestOutput


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        max_queue_len: int | None = None,
        sse_keepalive: float = 15.0,
        aliases: tuple[str, ...] = (),
        tokens_as_ids: bool = False,
    ) -> None:
        self.engine, self.model_name = engine, model_name
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
            message = f"The model `{model}` does not exist."
            raise APIError(message, 404, "not_found_error", "model", "model_not_found")

    def head(self, rid: str, obj: str, created: int, req: SamplingRequest) -> dict:
        return {"id": rid, "object": obj, "created": created, "model": req.model or self.model_name}

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
        if not errors:
            return results, notify
        for r in results:
            if isinstance(r, RequestStream):
                self.engine.abort(r.request_id)
        if not isinstance(errors[0], ValueError):
            raise errors[0]
        # The engine refused it; an InvalidParameter names the field, as the request did.
        param, message = getattr(errors[0], "param", None), str(errors[0])
        spelled = (renamed or {}).get(param, param)
        if param and spelled != param and message.startswith(param):
            message = spelled + message[len(param) :]
        raise APIError(message, param=spelled, code=getattr(errors[0], "code", None)) from None

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

    async def _abort_after(self, streams: list[RequestStream]) -> None:
        # A coroutine, so that starlette runs it on the loop: a plain function would take a
        # worker-thread hop per request (py-spy: 14% of the loop in a burst of short ones).
        self.abort_all(streams)

    def sse(self, chunks: AsyncIterator[bytes], streams: list[RequestStream]) -> SSEResponse:
        # The background task aborts even if the client left before the stream started.
        return SSEResponse(
            chunks, ping=self.sse_keepalive, background=BackgroundTask(self._abort_after, streams)
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
            raise APIError("this model has no tokenizer: send the prompt as token ids", "prompt")
        special = req.add_special_tokens
        encoded = iter(
            await self.engine.run_tokenizer(
                lambda tok: [tok.encode(t, add_special_tokens=special) for t in texts],
                sum(map(len, texts)),
            )
            if texts
            else []
        )
        full = [next(encoded) if isinstance(p, str) else p for p in req.prompt]
        prompts = [req.truncated(p, self.engine.info.max_model_len) for p in full]
        echo = await self._echo(req, prompts, full) if req.echo else None
        rid, created = f"cmpl-{req.request_id or uuid.uuid4().hex}", int(time.time())
        streams, notify = await self.start(rid, prompts, params, renamed(req))
        num_prompt = sum(len(p) for p in prompts)
        head = self.head(rid, "text_completion", created, req)
        if req.stream:
            chunks = self._completion_stream(head, streams, notify, req, params, echo, num_prompt)
            return self.sse(chunks, streams)
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
                choices.append(
                    {
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
                )
        choices.sort(key=lambda c: c["index"])
        usage = usage_of(num_prompt, num_out)
        unset = dict.fromkeys(("system_fingerprint", "service_tier", "kv_transfer_params"))
        return JSONResponse({**head, "choices": choices, "usage": usage, **unset})

    async def _echo(self, req: CompletionRequest, prompts: list[list[int]], full) -> list[str]:
        """Each prompt as echoed: a text prompt as sent; token ids, or a truncated text,
        decoded."""
        as_sent = [
            isinstance(p, str) and len(ids) == len(f)
            for p, ids, f in zip(req.prompt, prompts, full)
        ]
        if self.engine.tokenizer is None:
            return [p if keep else "" for p, keep in zip(req.prompt, as_sent)]
        todo = [ids for ids, keep in zip(prompts, as_sent) if not keep]
        it = iter(
            await self.engine.run_tokenizer(
                lambda tok: [tok.decode(ids) for ids in todo], sum(map(len, todo))
            )
        )
        return [p if keep else next(it) for p, keep in zip(req.prompt, as_sent)]

    def _completion_lps(
        self, st: ChoiceState, req: CompletionRequest, out: RequestOutput, token_ids, lps, first
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

        return sse_chunks(head, streams, notify, states, req, num_prompt, choices, self.abort_all)


def _returned(req: CompletionRequest, text: str, ids: list[int], lps, finish: str | None, stop):
    """A choice's output as returned: all of it, or for an echo-only request only its end."""
    if not req.echo_only:
        return text, ids, lps, finish, stop
    return "", [], [] if lps is not None else None, "length" if finish is not None else None, None


def renamed(req: SamplingRequest) -> dict[str, str]:
    """The engine's ``structured_outputs`` refusals, under the field the request used."""
    source = req.constraint_source()
    return {"structured_outputs": source} if source else {}
