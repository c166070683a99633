"""/v1/chat/completions: the prompt rendered through the chat template, then admitted,
collected and streamed by serving.py's ``OpenAIServing``; its choices, whole or as stream
deltas, for each ``tool_choice`` mode:

- ``none``: the text is the message's content.
- ``auto``: Hermes-style ``<tool_call>`` blocks in the text become ``tool_calls``
  (tool_calls.py); streamed, a call leaves as one ``tool_calls`` delta once its block closes,
  and the text of a call never leaves as content. ``finish_reason`` is ``tool_calls`` when the
  model called a tool and stopped by itself.
- named: the forced output is the arguments object; the call opens with its id and name and
  the arguments stream as they come. ``finish_reason`` stays ``stop``, as OpenAI's does.
- ``required``: the forced output is a JSON array of calls, sent whole when it is complete
  (streamed: in the choice's last chunk).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from streamkv.engine.async_engine import AsyncEngine
from streamkv.entrypoints.openai.chat_request import ChatCompletionRequest
from streamkv.entrypoints.openai.chat_template import chat_size, render_chat
from streamkv.entrypoints.openai.errors import APIError
from streamkv.entrypoints.openai.logprobs import LogprobFormatter
from streamkv.entrypoints.openai.protocol import TOOLS_SYSTEM_PROMPT, validate
from streamkv.entrypoints.openai.serving import OpenAIServing, renamed
from streamkv.entrypoints.openai.streaming import ChoiceState, deltas, sse_chunks, usage_of
from streamkv.entrypoints.openai.tool_calls import (
    HermesStream,
    parse_hermes,
    parse_required,
    tool_call,
)
from streamkv.sequence import CompletionOutput, RequestOutput


@dataclass(slots=True)
class ChatOutput:
    choices: list[dict]
    num_tokens: int


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _finish(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


class ChatResponder:
    def __init__(self, req: ChatCompletionRequest, fmt: LogprobFormatter, top: int | None) -> None:
        self.req, self.fmt, self.top = req, fmt, top
        self.mode = req.tool_mode()
        named = req.named_tool()
        self.name = named.function.name if named is not None else None
        last = req.messages[-1]
        self.echo = (last.text() or "") if req.echo and last.role == "assistant" else ""

    def _logprobs(self, token_ids: list[int], lps) -> dict | None:
        return self.fmt.chat_logprobs(token_ids, lps, self.top) if self.top is not None else None

    # -- whole ----------------------------------------------------------------------------
    def message(self, c: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        calls: list[dict] | None = None
        content: str | None = c.text
        if self.mode == "auto":
            content, calls = parse_hermes(c.text, self.req.parallel_tool_calls)
        elif self.mode == "named":
            # Cut off by max_tokens, the arguments are not JSON: no call, as in vLLM.
            cut = c.finish_reason == "length" and not _is_json(c.text)
            content, calls = (c.text, None) if cut else ("", [tool_call(self.name, c.text)])
        elif self.mode == "required":
            calls = parse_required(c.text)
            content = "" if calls or c.finish_reason == "length" else c.text
        if self.echo:  # vLLM's chat echo: the continued turn comes back whole
            content = self.echo + (content or "")
        # vLLM's message: every key present (null, or [] without calls).
        msg: dict[str, Any] = {
            "role": "assistant",
            "content": content,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": calls or [],
            "reasoning_content": None,
        }
        return msg, c.finish_reason if self.mode == "named" else _finish(
            c.finish_reason, bool(calls)
        )

    def whole(self, out: RequestOutput) -> ChatOutput:
        choices = []
        for c in out.outputs:
            msg, finish = self.message(c)
            choices.append(
                {
                    "index": c.index,
                    "message": msg,
                    "logprobs": self._logprobs(c.token_ids, c.logprobs),
                    "finish_reason": finish,
                    "stop_reason": c.stop_reason,
                    "token_ids": c.token_ids if self.req.return_token_ids else None,
                }
            )
        return ChatOutput(choices, sum(len(c.token_ids) for c in out.outputs))

    # -- streamed -------------------------------------------------------------------------
    def opening(self, states: list[ChoiceState]) -> list[dict]:
        return [
            {
                "index": st.index,
                "delta": {"role": "assistant", "content": self.echo},
                "logprobs": None,
                "finish_reason": None,
            }
            for st in states
        ]

    def stream_choices(
        self, states: list[ChoiceState]
    ) -> Callable[[int, RequestOutput], Iterator[dict]]:
        parsers = [HermesStream(self.req.parallel_tool_calls) for _ in states]
        texts = ["" for _ in states]
        n = len(states)

        def choices(_: int, out: RequestOutput) -> Iterator[dict]:
            for d in deltas(states, 0, n, out):
                k, done = d.choice.index, d.finish_reason is not None
                delta, called = self._delta(k, d.text, d.finish_reason, d.choice, parsers[k], texts)
                if not delta and not done and self.top is None and not self.req.return_token_ids:
                    continue
                if done and "content" not in delta:  # vLLM's last chunk: clients concatenate
                    delta["content"] = ""
                choice = {
                    "index": k,
                    "delta": delta,
                    "logprobs": self._logprobs(d.token_ids, d.logprobs),
                    "finish_reason": d.finish_reason
                    if self.mode == "named"
                    else _finish(d.finish_reason, called),
                }
                if done:
                    choice["stop_reason"] = d.stop_reason
                if self.req.return_token_ids:
                    choice["token_ids"] = d.token_ids
                yield choice

        return choices

    def _delta(
        self,
        k: int,
        text: str,
        finish: str | None,
        st: ChoiceState,
        parser: HermesStream,
        texts: list[str],
    ) -> tuple[dict, bool]:
        """This choice's delta for ``text``, and whether it has called a tool."""
        done = finish is not None
        if self.mode == "auto":
            content = parser.feed(text) + (parser.finish() if done else "")
            delta: dict[str, Any] = {"content": content} if content else {}
            fresh = parser.new_calls()
            if fresh:
                delta["tool_calls"] = [{"index": i, **call} for i, call in fresh]
            return delta, bool(parser.calls)
        if self.mode == "named":
            if not text:
                return {}, True
            if st.started:
                return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}, True
            st.started = True
            return {"tool_calls": [{"index": 0, **tool_call(self.name, text)}]}, True
        if self.mode == "required":
            texts[k] += text
            if not done:
                return {}, False
            calls = parse_required(texts[k])
            if calls is None:  # cut off by max_tokens: no call, no content (vLLM's answer)
                return {"content": "" if finish == "length" else texts[k]}, False
            return {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}, True
        return ({"content": text} if text else {}), False


class ChatServing:
    def __init__(
        self, engine: AsyncEngine, serving: OpenAIServing, auto_tool_choice: bool = True
    ) -> None:
        self.engine, self.serving, self.auto_tool_choice = engine, serving, auto_tool_choice

    async def prompt(self, req: ChatCompletionRequest) -> list[int]:
        self.serving.check_model(req.model)
        self.engine.check_alive()
        if self.engine.tokenizer is None:
            raise APIError("this model has no tokenizer, so no chat template", param="messages")
        if req.tool_mode() == "auto" and not self.auto_tool_choice:  # vLLM's answer
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

    async def _start(self, req: ChatCompletionRequest):
        params = req.params(self.serving.vocab_size())
        ids = await self.prompt(req)
        rid, created = f"chatcmpl-{req.request_id or uuid.uuid4().hex}", int(time.time())
        names = {"prompt": "messages", "logprobs": "top_logprobs", **renamed(req)}
        streams, notify = await self.serving.start(rid, [ids], params, names)
        responder = ChatResponder(
            req, self.serving.formatter(req), params.logprobs if req.logprobs else None
        )
        return params, ids, rid, created, streams, notify, responder

    async def completions(self, request: Request, body: dict) -> Response:
        req = validate(ChatCompletionRequest, body)
        if not req.stream:
            out = await self.whole(request, req)
            return Response(status_code=499) if out is None else JSONResponse(out)
        params, ids, rid, created, streams, notify, responder = await self._start(req)
        head = self.serving.head(rid, "chat.completion.chunk", created, req)
        states = [ChoiceState(k) for k in range(params.n)]
        extra = {"prompt_token_ids": ids} if req.return_token_ids else None
        chunks = sse_chunks(
            head,
            streams,
            notify,
            states,
            req,
            len(ids),
            responder.stream_choices(states),
            self.serving.abort_all,
            responder.opening(states),
            extra,
        )
        return self.serving.sse(chunks, streams)

    async def whole(self, request: Request | None, req: ChatCompletionRequest) -> dict | None:
        """A chat completion answered whole; None if the client went away first."""
        _, ids, rid, created, streams, notify, responder = await self._start(req)
        final = await self.serving.collect(request, streams, notify)
        if final is None:
            return None
        out = responder.whole(final[0])
        lps = final[0].prompt_logprobs
        # vLLM's response: its optional keys null when not asked for.
        return {
            **self.serving.head(rid, "chat.completion", created, req),
            "choices": out.choices,
            "usage": usage_of(len(ids), out.num_tokens),
            "system_fingerprint": None,
            "service_tier": None,
            "prompt_logprobs": None
            if req.prompt_logprobs is None
            else self.serving.logprobs.prompt_logprobs(lps),
            "prompt_token_ids": ids if req.return_token_ids else None,
            "kv_transfer_params": None,
        }
