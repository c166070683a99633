"""Admission: every rule that decides whether a request can *ever* run, behind one function.

``LLMEngine.add_request`` calls ``check_request`` before a request enters the waiting queue,
so a request the engine could never finish is refused at once with an error naming the
parameter to change, instead of waiting forever (a group larger than the pool, ``best_of``
over ``max_num_seqs``) or failing mid-step (a token id past the vocabulary indexes the
logits). The server maps ``InvalidParameter`` to its 400; it keeps no copy of these rules.

What is *not* decided here: whether the request fits *now* (the scheduler's ``can_allocate``)
and a request without ``max_tokens`` that outgrows the pool while running (the scheduler
ends it with an error when it is alone and still cannot grow).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from streamkv.core.block_pool import cdiv
from streamkv.sampling_params import InvalidParameter, SamplingParams

__all__ = ["EngineLimits", "InvalidParameter", "check_request", "peak_blocks"]


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """The engine's fixed capacity, known once the KV pool is sized: what admission checks
    and what a front end is told (``LLMEngine.info()``)."""

    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    num_swap_blocks: int
    usable_kv_blocks: int  # the device pool minus the scheduler's watermark
    max_num_seqs: int
    prefix_caching: bool


def peak_blocks(prompt_len: int, num_out: int, num_seqs: int, block_size: int) -> int:
    """Blocks a group holds at its largest: ``num_seqs`` sequences that share the prompt's
    full blocks (forked after the prompt) and each write ``num_out - 1`` tokens of their own
    (the last sampled token is never fed back, so it needs no slot)."""
    if num_out <= 1 or num_seqs == 1:
        return cdiv(prompt_len + max(num_out - 1, 0), block_size)
    shared = prompt_len // block_size
    own = cdiv(prompt_len + num_out - 1, block_size) - shared
    return shared + num_seqs * own


def _width_param(params: SamplingParams) -> str:
    return "n" if params.best_of == params.n else "best_of"


def _check_ids(name: str, ids: Iterable[int], vocab: int) -> None:
    bad = next(
        (t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab),
        None,
    )
    if bad is not None:
        raise InvalidParameter(
            name, f"{name} holds token id {bad!r}, outside the vocabulary [0, {vocab})"
        )


def check_request(
    prompt_token_ids: list[int], params: SamplingParams, limits: EngineLimits
) -> None:
    """Raise InvalidParameter unless the request could run to its end on an idle engine."""
    _check_token_ids(prompt_token_ids, params, limits.vocab_size)
    n, num_out = len(prompt_token_ids), params.max_tokens or 1
    _check_context(n, num_out, params.min_tokens, limits.max_model_len)
    _check_width(params, limits.max_num_seqs)
    _check_pool(n, num_out, params, limits)


def _check_token_ids(prompt_token_ids: list[int], params: SamplingParams, vocab: int) -> None:
    if len(prompt_token_ids) == 0:
        raise InvalidParameter("prompt", "the prompt is empty")
    if params.resumed_output_tokens >= len(prompt_token_ids):
        raise InvalidParameter(
            "resumed_output_tokens", "resumed_output_tokens must be less than the prompt's length."
        )
    _check_ids("prompt", prompt_token_ids, vocab)
    # Token ids of the parameters index the logits in the worker: an id past the vocabulary
    # would fail the whole batch's step, so it is refused here, for this request alone.
    _check_ids("stop_token_ids", params.stop_token_ids, vocab)
    _check_ids("logit_bias", params.logit_bias or (), vocab)
    _check_ids("allowed_token_ids", params.allowed_token_ids or (), vocab)


def _check_context(n: int, num_out: int, min_tokens: int, ctx: int) -> None:
    """The prompt and the completion (at least min_tokens of it) fit the context."""
    if n + num_out > ctx:
        raise InvalidParameter(
            "prompt" if n >= ctx else "max_tokens",
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{n + num_out} tokens ({n} in the prompt, {num_out} for the completion). Please "
            "reduce the length of the prompt or the completion.",
            "context_length_exceeded",
        )
    if min_tokens and n + min_tokens > ctx:
        # EOS stays banned for min_tokens: past the context the request could only end at
        # the context's edge, so it is refused like max_tokens.
        raise InvalidParameter(
            "min_tokens",
            f"This model's maximum context length is {ctx} tokens. However, you requested at "
            f"least {n + min_tokens} tokens ({n} in "
            f"the prompt, min_tokens={min_tokens}).",
            "context_length_exceeded",
        )


def _check_width(params: SamplingParams, max_num_seqs: int) -> None:
    """A request's sequences always run together, so they must fit in one batch."""
    width = params.best_of
    if width > max_num_seqs:
        what = "the beam width" if params.use_beam_search else _width_param(params)
        raise InvalidParameter(
            _width_param(params),
            f"{what} ({width}) may be at most the engine's max_num_seqs ({max_num_seqs}): "
            "a request's sequences always run together",
        )


def _check_pool(n: int, num_out: int, params: SamplingParams, limits: EngineLimits) -> None:
    """The prompt, then the whole group at its largest, fit the usable KV pool."""
    bs, pool = limits.block_size, limits.usable_kv_blocks
    if peak_blocks(n, 1, 1, bs) > pool:
        raise InvalidParameter(
            "prompt",
            f"the prompt needs {cdiv(n, bs)} KV-cache blocks, more than the whole pool "
            f"has ({pool} usable blocks of {bs} tokens)",
            "context_length_exceeded",
        )
    for seqs, param in ((1, "max_tokens"), (params.best_of, _width_param(params))):
        need = peak_blocks(n, num_out, seqs, bs)
        if need > pool:
            raise InvalidParameter(
                param,
                f"the request needs up to {need} KV-cache blocks ({n} prompt tokens + {num_out} "
                f"out, {seqs} sequence(s) sharing the prompt), more than the whole pool has "
                f"({pool} usable blocks of {bs} tokens)",
                "context_length_exceeded",
            )
