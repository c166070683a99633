"""The reserved-prefix admin API (paper §4.4; core/reserved_prefix.py):

    POST   /v1/prefixes          {"prompt": "text" | [token ids], "add_special_tokens": true}
                                 computes the prefix once (a one-token request) and pins it
    GET    /v1/prefixes          {"object": "list", "data": [prefix, ...]}
    DELETE /v1/prefixes/{id}     unpins it; its blocks are freed once no request maps them

A prefix is described as ``{"id", "object": "reserved_prefix", "num_tokens",
"num_shared_tokens", "num_blocks", "status", "num_uses"}``. Text is tokenized as the start of
a prompt (with the BOS token unless ``add_special_tokens`` is false), so a completion whose
prompt begins with the same text maps the prefix's whole blocks. Errors have the OpenAI
shape: bad input 400, an unknown id 404.

Prefixes registered here outlive a worker restart: the rebuilt engine registers them again
under the same ids and computes them before it takes requests
(engine/reserved_prefixes.carry_prefixes).
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from streamkv.core.reserved_prefix import ReservedPrefixError
from streamkv.engine.async_engine import AsyncEngine
from streamkv.engine.llm_engine import LLMEngine
from streamkv.engine.request_book import EngineDeadError
from streamkv.engine.reserved_prefixes import PREFIX_PARAMS, register_prefix, reserved_prefixes
from streamkv.entrypoints.openai.errors import APIError

T = TypeVar("T")
# How long a call waits for the engine thread (between two steps: normally milliseconds).
_ENGINE_CALL_TIMEOUT_S = 60.0


def _prompt_ids(body: dict) -> tuple[str | None, list[int] | None, bool]:
    unknown = sorted(set(body) - {"prompt", "add_special_tokens"})
    if unknown:
        raise APIError(
            f"unknown field(s) {unknown}; expected 'prompt' and 'add_special_tokens'",
            param=unknown[0],
        )
    prompt = body.get("prompt")
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise APIError("'add_special_tokens' must be true or false", param="add_special_tokens")
    if isinstance(prompt, str) and prompt:
        return prompt, None, special
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return None, prompt, special
    raise APIError(
        "'prompt' must be a non-empty string or a non-empty list of token ids", param="prompt"
    )


class PrefixAdmin:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def routes(self, api: Callable) -> list[Route]:
        """The routes, each wrapped by the server's ``api`` (auth, origin, body, errors)."""
        return [
            Route("/v1/prefixes", api(self.create), methods=["POST"]),
            Route("/v1/prefixes", api(self.list, body=False), methods=["GET"]),
            Route("/v1/prefixes/{prefix_id}", api(self.delete, body=False), methods=["DELETE"]),
        ]

    async def _on_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        """``fn(engine)`` where the engine runs, between two steps; its ValueError comes back."""
        self.engine.check_alive()
        try:
            return await self.engine.run_on_engine(fn, _ENGINE_CALL_TIMEOUT_S)
        except TimeoutError:
            raise EngineDeadError("the engine did not answer") from None

    async def create(self, request: Request, body: dict) -> Response:
        text, ids, special = _prompt_ids(body)
        if text is not None:
            if self.engine.tokenizer is None:
                raise APIError(
                    "this model has no tokenizer: send the prefix as token ids", param="prompt"
                )
            ids = await self.engine.run_tokenizer(
                lambda tok: tok.encode(text, add_special_tokens=special), len(text)
            )
        try:
            prefix = await self._on_engine(functools.partial(register_prefix, token_ids=list(ids)))
        except ValueError as e:
            raise APIError(str(e), param="prompt", code="invalid_prefix") from None
        if not prefix.ready:
            # Computed by an ordinary one-token request: its blocks are pinned the step they
            # are written (ReservedPrefixes.computed).
            stream = await self.engine.add_request(
                f"prefix-{uuid.uuid4().hex}", list(ids), PREFIX_PARAMS
            )
            async for _ in stream:
                pass
        return JSONResponse(
            await self._on_engine(functools.partial(describe_prefix, prefix_id=prefix.prefix_id))
        )

    async def list(self, request: Request) -> Response:
        try:
            data = await self._on_engine(describe_all)
        except ReservedPrefixError as e:
            raise APIError(str(e), code="invalid_prefix") from None
        return JSONResponse({"object": "list", "data": data})

    async def delete(self, request: Request) -> Response:
        prefix_id = request.path_params["prefix_id"]
        try:
            await self._on_engine(functools.partial(remove_prefix, prefix_id=prefix_id))
        except ReservedPrefixError as e:
            raise APIError(str(e), 404, param="prefix_id", code="prefix_not_found") from None
        return JSONResponse({"id": prefix_id, "object": "reserved_prefix", "deleted": True})


# What the routes run where the engine runs, between two steps (AsyncEngine.run_on_engine).
def describe_prefix(engine: LLMEngine, prefix_id: str) -> dict:
    registry = reserved_prefixes(engine)
    prefix = registry.prefixes.get(prefix_id)
    if prefix is None:
        raise ReservedPrefixError(f"no reserved prefix {prefix_id!r}: it was removed")
    return registry.describe(prefix)


def describe_all(engine: LLMEngine) -> list[dict]:
    registry = reserved_prefixes(engine)
    return [registry.describe(p) for p in registry.prefixes.values()]


def remove_prefix(engine: LLMEngine, prefix_id: str) -> None:
    reserved_prefixes(engine).remove(prefix_id)
