"""The fields both generation endpoints take that change nothing in the output (inert:
accepted, documented) and vLLM's extras this engine cannot honour (a 400 unless unset): the
request models' passive part (openai_requests.py has the fields that shape the output)."""

from __future__ import annotations

from pydantic import Field

from streamkv.entrypoints.openai_protocol import OpenAIModel, Unsupported


class PassiveFields(OpenAIModel):
    # Inert: OpenAI fields that do not change the output.
    user: str | None = Field(None, description="inert: an end-user id")
    metadata: dict[str, str] | None = Field(None, description="inert")
    store: bool | None = Field(None, description="inert: nothing is stored")
    service_tier: str | None = Field(None, description="inert")
    prompt_cache_key: str | None = Field(None, description="inert: prefix caching is automatic")
    safety_identifier: str | None = Field(None, description="inert")
    # vLLM extras this engine does not implement.
    priority: Unsupported = None
    bad_words: Unsupported = None
    logits_processors: Unsupported = None
