"""The request models of the generation endpoints, with OpenAI's field names and vLLM's
extras: the fields both share, and /v1/completions' (chat's are chat_request.py's,
/tokenize's and /detokenize's vllm_routes.py's). Each builds its ``SamplingParams``.

Ranges of sampling fields are ``SamplingParams``' own checks (an ``InvalidParameter`` naming
the field); whether a request can ever run is the engine's admission (core/admission.py).
Fields that change nothing in the output are accepted and listed under "inert" (docs/api.md).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from streamkv.entrypoints.openai.errors import APIError
from streamkv.entrypoints.openai.protocol import Int, OpenAIModel, PassiveFields, Unsupported
from streamkv.entrypoints.openai.structured_request import StructuredFields, structured_outputs
from streamkv.sampling_limits import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_CACHE_SALT,
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
)
from streamkv.sampling_params import InvalidParameter, SamplingParams

MAX_SAMPLES = 16  # cap on n, best_of and prompts per request
MAX_STOP = 32  # stop strings per request (OpenAI allows 4)

Samples = Annotated[int, Field(ge=1, le=MAX_SAMPLES)]
# Logprob counts: the engine caps them (--max-logprobs, checked when the request is added).
# -1 is vLLM's "the whole vocabulary" (so it passes the cap only with --max-logprobs -1).
TopK = Annotated[int, Field(ge=-1)]


def whole_vocab(k: int | None, vocab_size: int | None) -> int | None:
    """A logprob count with vLLM's -1 read as the vocabulary's size (unknown: left as -1, which
    SamplingParams refuses by name)."""
    return vocab_size if k == -1 and vocab_size is not None else k


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM: usage on every chunk")


class SamplingRequest(StructuredFields, PassiveFields):
    """The fields both generation endpoints share (those that change nothing, or that are
    refused, are protocol.py's ``PassiveFields``)."""

    model: str | None = Field(None, description="the served model's id; another name is a 404")
    n: Samples = 1
    best_of: Samples | None = Field(None, description="samples drawn, the n most likely returned")
    temperature: float | None = Field(None, description="default 1 (0 with use_beam_search)")
    top_p: float = 1.0
    top_k: Int = Field(-1, description="-1 or 0: no top-k (vLLM's rule)")
    min_p: float = 0.0
    seed: Int | None = None
    stop: Any = Field(None, description=f"a string or at most {MAX_STOP} strings")
    stop_token_ids: list[Int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: Int = 0
    use_beam_search: bool = Field(False, description="beam search, best_of beams")
    length_penalty: float = 1.0
    early_stopping: Any = Field(False, description='true, false or "never" (beam search)')
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Any = Field(None, description='{"token id": bias in [-100, 100]}')
    stream: bool = False
    stream_options: StreamOptions | None = None
    prompt_logprobs: TopK | None = Field(
        None, description="vLLM: logprobs of the prompt tokens (top k)"
    )
    return_token_ids: bool = Field(
        False, description="vLLM: the prompt's and each choice's token ids too"
    )
    return_tokens_as_token_ids: bool | None = Field(
        None,
        description=(
            'vLLM: logprobs name tokens "token_id:ID" (default: --return-tokens-as-token-ids)'
        ),
    )
    request_id: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="vLLM: the request's id (the response's is cmpl-/chatcmpl- + it)",
    )
    truncate_prompt_tokens: Int | None = Field(
        None, description="vLLM: keep only k of the prompt's tokens (-1: the context length)"
    )
    truncation_side: Literal["left", "right"] | None = Field(
        None, description='vLLM: "left" (default) cuts the prompt\'s start, "right" its end'
    )
    allowed_token_ids: list[Int] | None = Field(
        None,
        max_length=MAX_ALLOWED_TOKEN_IDS,
        description="vLLM: only these token ids may be sampled",
    )
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_CACHE_SALT,
        description="vLLM: prefix-cache blocks are shared only with requests of the same salt",
    )

    @field_validator("stop", mode="plain", json_schema_input_type=str | list[str] | None)
    @classmethod
    def _stop(cls, v: Any) -> str | list[str]:
        stops = [v] if isinstance(v, str) else v
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("must be a string or an array of strings")
        if len(stops) > MAX_STOP:
            raise ValueError(f"may hold at most {MAX_STOP} strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"strings may be at most {MAX_STOP_CHARS} characters long")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("must be -1 (the context length) or at least 1")
        return v

    def truncated(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's token ids after ``truncate_prompt_tokens``: its end is kept, as in vLLM,
        or its start with ``truncation_side: "right"``."""
        k = self.truncate_prompt_tokens
        if k is None or len(ids) <= (k := max_model_len if k == -1 else k):
            return ids
        return ids[:k] if self.truncation_side == "right" else ids[-k:]

    @field_validator("early_stopping", mode="plain", json_schema_input_type=bool | str)
    @classmethod
    def _early(cls, v: Any) -> bool | str:
        if v not in (True, False, "never") or isinstance(v, int) and not isinstance(v, bool):
            raise ValueError('must be true, false or "never"')
        return v

    @field_validator("logit_bias", mode="plain", json_schema_input_type=dict[str, float] | None)
    @classmethod
    def _logit_bias(cls, v: Any) -> dict[int, Any] | None:
        """OpenAI's form: keys are token ids as decimal strings (SamplingParams checks values)."""
        if not isinstance(v, dict):
            raise ValueError("must be an object")
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"may hold at most {MAX_LOGIT_BIAS} tokens")
        for key in v:
            if not (key.isascii() and key.isdigit() and len(key) <= 18):
                raise ValueError(f"keys must be token ids, got {key[:40]!r}")
        return {int(k): b for k, b in v.items()} or None

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        constraint: tuple[dict[str, Any] | None, str | None],
    ) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise APIError(
                "'stream_options' is only allowed with stream=true", param="stream_options"
            )
        if self.stream and self.prompt_logprobs is not None:
            raise APIError(
                "'prompt_logprobs' is not available with stream=true", param="prompt_logprobs"
            )
        fields, source = constraint
        try:
            params = SamplingParams(
                **self._request_fields(),
                max_tokens=max_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                structured_outputs=structured_outputs(fields, source),
            )
        except InvalidParameter as e:
            param = source if e.param == "structured_outputs" and source else e.param
            raise APIError(str(e), param=param) from None
        if self.stream and params.use_beam_search:
            raise APIError(
                "'use_beam_search' cannot be combined with stream=true", param="use_beam_search"
            )
        if self.stream and params.best_of > params.n:
            raise APIError(
                "'best_of' must equal n with stream=true "
                "(the best samples are only known at the end)",
                param="best_of",
            )
        return params

    def _request_fields(self) -> dict[str, Any]:
        """The SamplingParams fields taken from the request as sent, with vLLM's readings of
        an unset temperature and of top_k 0."""
        beam = self.use_beam_search
        # Beam search is deterministic: it defaults to (and needs) temperature 0.
        temperature = self.temperature if self.temperature is not None else 0.0 if beam else 1.0
        return dict(
            n=self.n,
            best_of=self.best_of,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            temperature=temperature,
            top_p=self.top_p,
            # vLLM reads top_k 0 as "all tokens", as -1 (clients that default to 0 send it).
            top_k=-1 if self.top_k == 0 else self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            use_beam_search=beam,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            cache_salt=self.cache_salt,
        )

    def constraint_source(self) -> str | None:
        """The field that states the output constraint, if any."""
        return self.structured()[1]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: list[str | list[int]] = Field(
        description=(
            f"a string, strings, token ids, or token-id lists (at most {MAX_SAMPLES} prompts)"
        )
    )
    max_tokens: Int = Field(16, description="0 only with echo: the prompt (and its logprobs) alone")
    echo: bool = Field(False, description="prepend the prompt (with logprobs: the prompt's too)")
    logprobs: TopK | None = Field(None, description="top-k logprobs per token (+ the chosen one)")
    add_special_tokens: bool = True
    suffix: Unsupported = None

    @field_validator(
        "prompt", mode="plain", json_schema_input_type=str | list[str] | list[int] | list[list[int]]
    )
    @classmethod
    def _prompts(cls, v: Any) -> list[str | list[int]]:
        if isinstance(v, str) or (_is_ids(v) and v):
            v = [v]
        if not isinstance(v, list) or not v:
            raise ValueError("must be a string, an array of strings or token ids, and not empty")
        for p in v:
            if not (isinstance(p, str) or _is_ids(p)):
                raise ValueError(
                    "must be a string, an array of strings, or an array of token-id arrays"
                )
            if not p:
                raise ValueError("must not be empty")
        if len(v) > MAX_SAMPLES:
            raise ValueError(f"may hold at most {MAX_SAMPLES} prompts")
        return v

    @property
    def echo_only(self) -> bool:
        """OpenAI's legacy scoring call (``echo`` with ``max_tokens: 0``, as lm-eval-harness
        sends it): the prompt comes back, with its logprobs, and no completion."""
        return self.echo and self.max_tokens == 0

    def params(self, vocab_size: int | None = None) -> SamplingParams:
        logprobs = whole_vocab(self.logprobs, vocab_size)
        # OpenAI's legacy echo + logprobs: the prompt's tokens are scored too.
        echoed = logprobs if self.echo and logprobs is not None else None
        prompt_lps = max(
            (k for k in (echoed, whole_vocab(self.prompt_logprobs, vocab_size)) if k is not None),
            default=None,
        )
        unknown = vocab_size is None and -1 in (self.logprobs, self.prompt_logprobs)
        if unknown and prompt_lps is not None:
            prompt_lps = -1  # the vocabulary is unknown here: SamplingParams refuses it by name
        # The prefill pass that scores the prompt samples one token too (vLLM does the same);
        # an echo-only response leaves it out.
        max_tokens = 1 if self.echo_only else self.max_tokens
        return self.sampling_params(max_tokens, logprobs, prompt_lps, self.structured())
