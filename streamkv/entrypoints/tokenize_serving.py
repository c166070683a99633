"""/tokenize and /detokenize (vLLM's): the served model's tokenizer and chat template, on the
tokenizer threads like every other request's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import Field, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from streamkv.engine.async_engine import AsyncEngine
from streamkv.entrypoints.chat_messages import ChatMessage, Tool
from streamkv.entrypoints.chat_template import chat_size, check_template_kwargs, render_chat
from streamkv.entrypoints.openai_protocol import (
    TOOLS_SYSTEM_PROMPT,
    APIError,
    Int,
    OpenAIModel,
    validate,
)


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
