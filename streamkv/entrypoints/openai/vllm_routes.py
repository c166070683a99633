"""Routes vLLM serves beside the OpenAI API, for the tools built around it:

- ``GET|POST /ping`` and ``POST /invocations``: SageMaker's health check and its one
  inference route (a body with ``messages`` is a chat completion, with ``prompt`` a
  completion);
- ``POST /v1/chat/completions/batch``: several conversations (``messages`` is a list of
  them) with one set of parameters, answered whole as one ``chat.completion`` whose choice
  ``index`` is the conversation's;
- ``GET /load``: requests in the engine now (running, waiting or swapped), vLLM's
  ``server_load``, which load balancers read;
- ``GET /tokenizer_info``: the tokenizer's class, its configuration and chat template;
- ``POST /tokenize`` and ``POST /detokenize`` (``TokenizeServing``): the served model's
  tokenizer and chat template, on the tokenizer threads like every other request's.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import Field, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from streamkv.engine.async_engine import AsyncEngine
from streamkv.entrypoints.openai.chat_messages import ChatMessage, Tool
from streamkv.entrypoints.openai.chat_request import ChatCompletionRequest
from streamkv.entrypoints.openai.chat_serving import ChatServing
from streamkv.entrypoints.openai.chat_template import chat_size, check_template_kwargs, render_chat
from streamkv.entrypoints.openai.errors import APIError
from streamkv.entrypoints.openai.protocol import TOOLS_SYSTEM_PROMPT, Int, OpenAIModel, validate
from streamkv.entrypoints.openai.serving import OpenAIServing

_PLAIN = (str, int, float, bool, type(None))


class VLLMRoutes:
    def __init__(
        self, engine: AsyncEngine, serving: OpenAIServing, chat: ChatServing, health: Callable
    ) -> None:
        self.engine, self.serving, self.chat, self.health = engine, serving, chat, health

    def routes(self, api: Callable) -> list[Route]:
        return [
            Route("/ping", self.health, methods=["GET", "POST"]),
            Route("/invocations", api(self.invocations), methods=["POST"]),
            Route("/v1/chat/completions/batch", api(self.chat_batch), methods=["POST"]),
            Route("/load", api(self.load, body=False)),
            Route("/tokenizer_info", api(self.tokenizer_info, body=False)),
        ]

    async def invocations(self, request: Request, body: dict) -> Response:
        if "messages" in body:
            return await self.chat.completions(request, body)
        if "prompt" in body:
            return await self.serving.completions(request, body)
        raise APIError(
            "/invocations takes a chat completion ('messages') or a completion ('prompt')"
        )

    async def chat_batch(self, request: Request, body: dict) -> Response:
        convs = body.get("messages")
        if not isinstance(convs, list) or not convs or not all(isinstance(c, list) for c in convs):
            raise APIError(
                "'messages' must be a non-empty array of conversations (arrays of messages)",
                param="messages",
            )
        if body.get("stream"):
            raise APIError("a batch is answered whole: stream must be false", param="stream")
        if body.get("n", 1) != 1:
            raise APIError("a batch takes n=1 (one choice per conversation)", param="n")
        reqs = []
        for i, conv in enumerate(convs):
            try:
                reqs.append(validate(ChatCompletionRequest, {**body, "messages": conv}))
            except APIError as e:  # name the conversation in the parameter
                if e.param and e.param.startswith("messages"):
                    e.param = f"messages[{i}]{e.param[len('messages') :]}"
                raise
        for req in reqs:  # every conversation's parameters checked before any runs
            req.params(self.serving.vocab_size())
        outs = await asyncio.gather(*(self.chat.whole(request, req) for req in reqs))
        if any(out is None for out in outs):
            return Response(status_code=499)
        first, choices = outs[0], []
        for i, out in enumerate(outs):
            choices.extend({**c, "index": i} for c in out["choices"])
        usage = {k: sum(out["usage"][k] for out in outs) for k in first["usage"]}
        return JSONResponse({**first, "choices": choices, "usage": usage})

    async def load(self, request: Request) -> Response:
        s = self.engine.stats or {}
        return JSONResponse(
            {"server_load": sum(s.get(k, 0) for k in ("num_running", "num_waiting", "num_swapped"))}
        )

    async def tokenizer_info(self, request: Request) -> Response:
        self.engine.check_alive()
        tok = self.engine.tokenizer
        if tok is None:
            raise APIError("this model has no tokenizer", 404, "not_found_error")
        config = {
            k: v for k, v in (getattr(tok, "init_kwargs", None) or {}).items() if _is_plain(v)
        }
        return JSONResponse(
            {
                **config,
                "tokenizer_class": type(tok).__name__,
                "chat_template": getattr(tok, "chat_template", None),
            }
        )


def model_permission() -> dict[str, Any]:
    """The ``permission`` entry of vLLM's model card (what OpenAI's cards once carried)."""
    return {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": int(time.time()),
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


def _is_plain(v: Any) -> bool:
    """JSON-able: tokenizer configs hold AddedToken objects and paths beside plain values."""
    if isinstance(v, _PLAIN):
        return True
    if isinstance(v, list | tuple):
        return all(_is_plain(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _is_plain(x) for k, x in v.items())
    return False


class TokenizeRequest(OpenAIModel):
    """POST /tokenize: ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = Field(
        None, description="default: true for prompt, false for messages"
    )
    add_generation_prompt: bool = True
    # As a chat request renders them, so that the count matches the chat's prompt_tokens.
    tools: list[Tool] | None = Field(
        None, description="messages: the tools offered, rendered as a chat renders them"
    )
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    return_token_strs: bool = Field(False, description="vLLM: each token's string too (token_strs)")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any]) -> dict[str, Any]:
        return check_template_kwargs(v)


class DetokenizeRequest(OpenAIModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[Int]


class TokenizeServing:
    def __init__(self, engine: AsyncEngine, check_model: Callable[[str | None], None]) -> None:
        self.engine, self.check_model = engine, check_model

    async def tokenize(self, request: Request, body: dict) -> Response:
        req = validate(TokenizeRequest, body)
        self.check_model(req.model)
        if req.messages is None and req.prompt is None:
            raise APIError("'prompt' is required (or 'messages')", param="prompt")
        self.engine.check_alive()
        if self.engine.tokenizer is None:
            raise APIError("this model has no tokenizer")
        if req.messages is not None:
            if req.continue_final_message and req.add_generation_prompt:
                raise APIError(
                    "'continue_final_message' needs add_generation_prompt=false",
                    param="continue_final_message",
                )
            tools_prompt = (
                TOOLS_SYSTEM_PROMPT.get()
            )  # read here: the tokenizer thread has no context
            ids = await self.engine.run_tokenizer(
                lambda t: render_chat(
                    t,
                    req.messages,
                    req.add_generation_prompt,
                    bool(req.add_special_tokens),
                    req.tools,
                    req.chat_template_kwargs,
                    req.continue_final_message,
                    tools_prompt,
                ),
                chat_size(req.messages, req.tools),
            )
        else:
            ids = await self.engine.run_tokenizer(
                lambda t: t.encode(
                    req.prompt, add_special_tokens=req.add_special_tokens is not False
                ),
                len(req.prompt),
            )
        strs = None
        if req.return_token_strs:
            strs = await self.engine.run_tokenizer(lambda t: t.convert_ids_to_tokens(ids), len(ids))
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": self.engine.info.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(self, request: Request, body: dict) -> Response:
        req = validate(DetokenizeRequest, body)
        self.check_model(req.model)
        self.engine.check_alive()
        vocab = self.engine.info.vocab_size
        if not all(0 <= t < vocab for t in req.tokens):
            raise APIError(f"'tokens' must be token ids in [0, {vocab})", param="tokens")
        if self.engine.tokenizer is None:
            raise APIError("this model has no tokenizer")
        text = await self.engine.run_tokenizer(lambda t: t.decode(req.tokens), len(req.tokens))
        return JSONResponse({"prompt": text})
