"""Chat messages, tools and tool choice as request models (OpenAI's shapes).

Unions are told apart by callable discriminators whose tags are written ``<like-this>``, so
that an error's location names fields only (protocol.param_of skips the tags).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator

from streamkv.entrypoints.openai.protocol import OpenAIModel

_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class TextPart(OpenAIModel):
    type: Literal["text"] = Field(description="only text parts: other content types are a 400")
    text: str


def _content_kind(v: Any) -> str | None:
    return "<str>" if isinstance(v, str) else "<parts>" if isinstance(v, list) else None


Content = Annotated[
    Annotated[str, Tag("<str>")] | Annotated[list[TextPart], Tag("<parts>")],
    Discriminator(
        _content_kind,
        custom_error_type="content_type",
        custom_error_message="must be a string or an array of text parts",
    ),
]


class FunctionCall(OpenAIModel):
    name: str
    # OpenAI sends JSON text; vLLM also takes the object itself (some clients send that).
    arguments: str | dict[str, Any] = Field(
        "", description="the arguments as JSON text (or as an object)"
    )


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    """One turn. ``developer`` is read as ``system``; an assistant turn may carry
    ``tool_calls`` instead of content; a ``tool`` turn answers the call ``tool_call_id``.
    A role OpenAI does not name (``ipython``, ``observation``, ...) reaches the chat template
    as it is, as vLLM passes it: a template that does not know it says so (a 400)."""

    role: str = Field(min_length=1, max_length=64)
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="assistant turns only")
    tool_call_id: str | None = Field(
        None, validate_default=True, description="tool turns: the call answered"
    )
    # After the fields it depends on (validated in order): content may be absent only from
    # an assistant turn that calls tools.
    content: Content | None = Field(None, validate_default=True)

    @field_validator("tool_calls")
    @classmethod
    def _only_assistant_calls(
        cls, v: list[ToolCall] | None, info: ValidationInfo
    ) -> list[ToolCall] | None:
        if v is not None and info.data.get("role") != "assistant":
            raise ValueError("is only allowed on assistant messages")
        return v

    @field_validator("tool_call_id")
    @classmethod
    def _tool_answers_a_call(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None and info.data.get("role") == "tool":
            raise ValueError("is required on tool messages")
        return v

    @field_validator("content")
    @classmethod
    def _content_present(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError("must be a string or an array of text parts")
        return v

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = Field(None, description="accepted: forced calls always follow the schema")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _FUNCTION_NAME.match(v):
            raise ValueError("must be 1-64 letters, digits, '_' or '-'")
        return v


class Tool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


def _choice_kind(v: Any) -> str | None:
    return "<mode>" if isinstance(v, str) else "<named>" if isinstance(v, dict) else None


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("<mode>")]
    | Annotated[NamedToolChoice, Tag("<named>")],
    Discriminator(
        _choice_kind,
        custom_error_type="tool_choice_type",
        custom_error_message='must be "none", "auto", "required" or {"type": "function", ...}',
    ),
]
