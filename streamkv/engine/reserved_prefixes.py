"""Reserved prefixes on an engine (paper §4.4; the registry is core/reserved_prefix.py): register,
compute (a one-token request each) and, after a worker restart, carry the prefixes a client
registered over to the new engine under the same ids. Called on the engine's thread."""

from __future__ import annotations

from streamkv.core.admission import InvalidParameter, check_request
from streamkv.core.block_manager import BlockManager
from streamkv.core.reserved_prefix import ReservedPrefix, ReservedPrefixError, ReservedPrefixes
from streamkv.engine.llm_engine import LLMEngine
from streamkv.sampling_params import SamplingParams

# The request that computes a reserved prefix: its prompt is the prefix, one token sampled.
PREFIX_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


def reserved_prefixes(engine: LLMEngine) -> ReservedPrefixes:
    """The engine's reserved-prefix registry (call on the engine's thread)."""
    bm = engine.block_manager
    if not isinstance(bm, BlockManager):
        raise ReservedPrefixError(
            "reserved prefixes need the paged KV cache (kv_allocation='paged')"
        )
    return bm.reserved


def register_prefix(engine: LLMEngine, token_ids: list[int]) -> ReservedPrefix:
    """A reserved prefix on ``engine``, pending until a request computes it (call on the
    engine's thread). Raises ReservedPrefixError (a ValueError)."""
    registry = reserved_prefixes(engine)
    try:
        check_request(list(token_ids), PREFIX_PARAMS, engine.limits)
    except InvalidParameter as e:
        raise ReservedPrefixError(f"the prefix cannot run as a request: {e}") from None
    return registry.add(token_ids)


def compute_prefixes(engine: LLMEngine, prefixes: list[ReservedPrefix]) -> None:
    """Run each pending prefix as a one-token request, to completion (the engine must be
    idle: this steps it until nothing is left). Pinned when computed."""
    pending = [p for p in prefixes if not p.ready]
    for p in pending:
        engine.add_request(f"reserved-prefix:{p.prefix_id}", None, PREFIX_PARAMS, list(p.token_ids))
    while engine.has_unfinished_requests():
        engine.step(finished_only=True)
    failed = [p for p in pending if not p.ready]
    for p in failed:
        reserved_prefixes(engine).remove(p.prefix_id)
    if failed:
        raise ReservedPrefixError(
            f"reserved prefix(es) {[p.prefix_id for p in failed]} could not be computed "
            "(the KV pool cannot hold them)"
        )


def carry_prefixes(old: LLMEngine, new: LLMEngine) -> list[str]:
    """Register ``old``'s reserved prefixes on ``new`` (a restart's fresh engine, idle) under
    the same ids and compute them before it takes requests: a prefix registered through
    ``/v1/prefixes`` outlives a worker restart, and its owner's id still names it. Returns
    the ids carried; a prefix the new pool cannot hold is dropped (compute_prefixes raises)."""
    before = getattr(old.block_manager, "reserved", None)
    if not isinstance(new.block_manager, BlockManager) or before is None or not before.prefixes:
        return []
    registry = reserved_prefixes(new)
    carried = [registry.add(p.token_ids, prefix_id=p.prefix_id) for p in before.prefixes.values()]
    compute_prefixes(new, carried)
    return [p.prefix_id for p in carried]
