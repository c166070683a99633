"""Structured outputs as requests spell them → one ``StructuredOutputs`` record.

Three spellings reach the same record (streamkv/sampling_params.py; the engine compiles and
enforces it, engine/structured.py):
- OpenAI's ``response_format``: ``{"type": "json_object"}`` or ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}`` (``text`` is no constraint);
- vLLM's ``structured_outputs``: ``{"json" | "json_object" | "regex" | "choice" | "grammar"}``;
- vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``.
A grammar in Lark's syntax becomes EBNF here (lark_grammar.py), as vLLM converts it.
At most one constraint per request; the field that states it is its ``param`` in errors.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from streamkv.engine.grammar_limits import MAX_SPEC_CHARS
from streamkv.entrypoints.openai.errors import APIError
from streamkv.entrypoints.openai.lark_grammar import LarkError, is_lark, lark_to_ebnf
from streamkv.entrypoints.openai.protocol import OpenAIModel, Unsupported
from streamkv.sampling_params import InvalidParameter, StructuredOutputs


def _schema_or_text(v: Any) -> Any:
    if not isinstance(v, dict | str):
        raise ValueError("must be a JSON schema (an object, or its JSON text)")
    return v


class JSONSchemaSpec(OpenAIModel):
    name: str = Field(description="the schema's name (OpenAI requires it; not used for decoding)")
    description: str | None = None
    schema_: dict[str, Any] = Field(
        alias="schema", description="the JSON schema the output follows"
    )
    strict: bool | None = Field(None, description="accepted: the schema is always enforced")


class TextFormat(OpenAIModel):
    type: Literal["text"]


class JSONObjectFormat(OpenAIModel):
    type: Literal["json_object"]


class JSONSchemaFormat(OpenAIModel):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


def _format_kind(v: Any) -> str | None:
    kind = v.get("type") if isinstance(v, dict) else None
    return f"<{kind}>" if kind in ("text", "json_object", "json_schema") else None


ResponseFormat = Annotated[
    Annotated[TextFormat, Tag("<text>")]
    | Annotated[JSONObjectFormat, Tag("<json_object>")]
    | Annotated[JSONSchemaFormat, Tag("<json_schema>")],
    Discriminator(
        _format_kind,
        custom_error_type="response_format_type",
        custom_error_message='must be {"type": "text" | "json_object" | "json_schema", ...}',
    ),
]


class StructuredOutputsRequest(OpenAIModel):
    """vLLM's ``structured_outputs`` object: set exactly one constraint."""

    json_: Any = Field(None, alias="json", description="a JSON schema (an object or its JSON text)")
    json_object: bool | None = Field(None, description="any JSON object")
    regex: str | None = None
    choice: list[str] | None = Field(None, description="the output is one of these strings")
    grammar: str | None = Field(
        None, description="an EBNF (GBNF) grammar, or a Lark one (converted, as vLLM does)"
    )
    disable_fallback: bool | None = Field(None, description="accepted: there is one grammar engine")
    whitespace_pattern: Unsupported = None
    disable_any_whitespace: Unsupported = None
    disable_additional_properties: Unsupported = None
    structural_tag: Unsupported = None

    @field_validator("json_")
    @classmethod
    def _json(cls, v: Any) -> Any:
        return _schema_or_text(v)


class StructuredFields(OpenAIModel):
    """The structured-output fields of both generation endpoints."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: Any = Field(None, description="vLLM's older spelling of structured_outputs.json")
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = Field(
        None, description="accepted: there is one grammar engine"
    )
    guided_whitespace_pattern: Unsupported = None

    @field_validator("guided_json")
    @classmethod
    def _guided_json(cls, v: Any) -> Any:
        return _schema_or_text(v)

    def structured(self) -> tuple[dict[str, Any] | None, str | None]:
        """The constraint as StructuredOutputs' fields, and the field that asked for it."""
        found: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if isinstance(fmt, JSONObjectFormat):
            found.append(("response_format", {"json_object": True}))
        elif isinstance(fmt, JSONSchemaFormat):
            found.append(("response_format", {"json": fmt.json_schema.schema_}))
        so = self.structured_outputs
        if so is not None:
            fields = {
                "json": so.json_,
                "json_object": so.json_object or None,
                "regex": so.regex,
                "choice": so.choice,
                "grammar": so.grammar,
            }
            found.append(("structured_outputs", {k: v for k, v in fields.items() if v is not None}))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                found.append((f"guided_{name}", {name: value}))
        if len(found) > 1:
            raise APIError(
                f"'{found[1][0]}' cannot be combined with '{found[0][0]}': "
                "a request takes one output constraint",
                param=found[1][0],
            )
        if not found:
            return None, None
        source, fields = found[0]
        if isinstance(fields.get("grammar"), str):
            fields["grammar"] = ebnf_grammar(fields["grammar"], source)
        return fields, source


def ebnf_grammar(grammar: str, param: str) -> str:
    """The grammar as EBNF: a Lark grammar (no ``::=`` anywhere) converted, as vLLM does."""
    if len(grammar) > MAX_SPEC_CHARS or not is_lark(grammar):
        return grammar  # the grammar limits refuse an oversized one by name
    try:
        return lark_to_ebnf(grammar)
    except LarkError as e:
        raise APIError(
            f"'{param}': the Lark grammar cannot be converted to EBNF: {e}", param=param
        ) from None


def structured_outputs(
    fields: dict[str, Any] | None, param: str | None
) -> StructuredOutputs | None:
    """The record, its own checks reported under the field the request used."""
    if fields is None:
        return None
    try:
        return StructuredOutputs(**fields)
    except InvalidParameter as e:
        raise APIError(str(e), param=param) from None
