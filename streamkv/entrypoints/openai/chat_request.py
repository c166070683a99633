"""The chat completion request: the shared sampling fields (requests.py), the conversation,
tools and ``tool_choice``. A forced tool choice becomes a JSON-schema constraint on the output.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from streamkv.entrypoints.openai.chat_messages import ChatMessage, NamedToolChoice, Tool, ToolChoice
from streamkv.entrypoints.openai.chat_template import check_template_kwargs
from streamkv.entrypoints.openai.errors import APIError
from streamkv.entrypoints.openai.protocol import Int, Unsupported
from streamkv.entrypoints.openai.requests import SamplingRequest, TopK, whole_vocab
from streamkv.entrypoints.openai.tool_calls import forced_tool_schema
from streamkv.sampling_params import SamplingParams


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions (and the WebSocket's ``params`` with its ``messages``)."""

    messages: list[ChatMessage]
    max_tokens: Int | None = Field(None, description="default: the rest of the context")
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: TopK | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = Field(
        None, description='default "auto" with tools, else "none"'
    )
    parallel_tool_calls: bool = Field(True, description="false: at most one tool call")
    reasoning_effort: str | None = Field(None, description="inert: the model does not reason")
    prediction: dict[str, Any] | None = Field(
        None, description="inert: predicted outputs change latency only"
    )
    modalities: list[str] | None = Field(None, description='only ["text"]')
    audio: Unsupported = None
    functions: Unsupported = None
    function_call: Unsupported = None
    web_search_options: Unsupported = None
    chat_template: Unsupported = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM: extra variables for the chat template (e.g. enable_thinking)"
    )
    documents: Unsupported = None
    continue_final_message: bool = Field(
        False,
        description=(
            "vLLM: the output continues the last (assistant) "
            "message; needs add_generation_prompt=false"
        ),
    )
    echo: bool = Field(
        False,
        description="vLLM: the reply's content starts with the last message's when that "
        "is the assistant's (with continue_final_message: the whole turn)",
    )

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("must not be empty")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any]) -> dict[str, Any]:
        return check_template_kwargs(v)

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, v: list[str]) -> list[str]:
        if v != ["text"]:
            raise ValueError('may only be ["text"]')
        return v

    @field_validator("tools")
    @classmethod
    def _some_tools(cls, v: list[Tool]) -> list[Tool]:
        if not v:
            raise ValueError("must not be empty (leave it out to offer no tools)")
        return v

    def tool_mode(self) -> str:
        """none | auto | required | named (unset: ``auto`` with tools, else ``none``). A
        choice other than ``none`` without tools is refused (``params``), as vLLM does."""
        choice = self.tool_choice or "auto"
        if isinstance(choice, NamedToolChoice):
            return "named"
        return "none" if choice == "auto" and not self.tools else choice

    def named_tool(self) -> Tool | None:
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        return next(
            (t for t in self.tools or () if t.function.name == self.tool_choice.function.name), None
        )

    def constraint_source(self) -> str | None:
        return (
            "tool_choice"
            if self.tool_mode() in ("required", "named")
            else super().constraint_source()
        )

    def params(self, vocab_size: int | None = None) -> SamplingParams:
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(
                "'continue_final_message' needs add_generation_prompt=false",
                param="continue_final_message",
            )
        top = whole_vocab(self.top_logprobs, vocab_size)
        if top is not None and not self.logprobs:
            raise APIError("'top_logprobs' needs logprobs=true", param="top_logprobs")
        # OpenAI's newer name wins over the deprecated one when both are sent, as in vLLM.
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        constraint = self.structured()
        mode = self.tool_mode()
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise APIError(
                "'tool_choice' needs tools: when using tool_choice, tools must be set",
                param="tool_choice",
            )
        if mode == "named" and self.named_tool() is None:
            raise APIError(
                f"'tool_choice' names {self.tool_choice.function.name!r}, which is not in tools",
                param="tool_choice",
            )
        if mode in ("required", "named"):
            if constraint[0] is not None:
                raise APIError(
                    f"a forced tool_choice cannot be combined with '{constraint[1]}'",
                    param="tool_choice",
                )
            schema = forced_tool_schema(self.tools, self.named_tool(), self.parallel_tool_calls)
            constraint = ({"json": schema}, "tool_choice")
        return self.sampling_params(
            max_tokens,
            (top or 0) if self.logprobs else None,
            whole_vocab(self.prompt_logprobs, vocab_size),
            constraint,
        )
