"""The offline API, with vLLM's names: ``LLM(...).generate(prompts, sampling_params)``;
and ``build_engine``, an engine with its ``--reserved-prefix`` files registered, which the
server shares (the prefixes themselves are engine/reserved_prefixes.py's)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq

from streamkv.config import EngineConfig
from streamkv.engine.llm_engine import LLMEngine
from streamkv.engine.reserved_prefixes import compute_prefixes, register_prefix, reserved_prefixes
from streamkv.entrypoints.args import engine_config
from streamkv.executor.base import Executor
from streamkv.sampling_params import BeamSearchParams, SamplingParams
from streamkv.sequence import RequestOutput

__all__ = [
    "LLM",
    "EngineStats",
    "build_engine",
    "engine_config",
]


def read_prefix_files(paths: Seq[str], tokenizer) -> list[list[int]]:
    """Token ids of each ``--reserved-prefix`` file (UTF-8 text, tokenized as a prompt's start)."""
    out = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read the reserved prefix file {path!r}: {e}") from None
        if tokenizer is None:
            raise ValueError(
                "this model has no tokenizer: a reserved prefix file cannot be tokenized"
            )
        out.append(tokenizer.encode(text))
    return out


def build_engine(config: EngineConfig, executor: Executor | None = None) -> LLMEngine:
    """An engine with ``config.cache.reserved_prefix``'s files registered and computed."""
    engine = LLMEngine(config, executor)
    try:
        token_lists = read_prefix_files(config.cache.reserved_prefix, engine.tokenizer)
        compute_prefixes(engine, [register_prefix(engine, ids) for ids in token_lists])
    except BaseException:
        engine.shutdown()
        raise
    return engine


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        """``kwargs`` are the engine arguments: the config dataclasses' field names
        (entrypoints/args.py; the same as the command's flags)."""
        self.engine = build_engine(engine_config(model, **kwargs))
        self._ids = itertools.count()

    # -- reserved prefixes (paper §4.4) -----------------------------------------------------
    def register_prefix(self, prefix: str | Seq[int]) -> str:
        """Compute ``prefix`` (text, tokenized as a prompt's start, or token ids) once and pin
        its whole blocks; every later prompt that starts with it maps them read-only. Returns
        its id. Text prompts share it only where they tokenize to the same leading tokens:
        pass token ids, or end the text at a natural boundary (a newline)."""
        if isinstance(prefix, str):
            if self.engine.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids")
            prefix = self.engine.tokenizer.encode(prefix)
        record = register_prefix(self.engine, list(prefix))
        compute_prefixes(self.engine, [record])
        return record.prefix_id

    def unregister_prefix(self, prefix_id: str) -> None:
        """Drop the pins; blocks go back to the pool once no request maps them."""
        reserved_prefixes(self.engine).remove(prefix_id)

    def reserved_prefixes(self) -> list[dict]:
        """Each prefix's id, tokens, shared blocks, status and uses."""
        registry = reserved_prefixes(self.engine)
        return [registry.describe(p) for p in registry.prefixes.values()]

    def shutdown(self) -> None:
        """Stop the worker processes (if any) now, rather than at interpreter exit."""
        self.engine.shutdown()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (its blocks return to the free list), so that
        the next requests compute their prompts cold. Reserved prefixes stay."""
        self.engine.reset_prefix_cache()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        """The engine's counters: a dict (every key of ``LLMEngine.stats()``) that prints as
        a short summary; ``dict(llm.stats())`` for the raw numbers."""
        return EngineStats(self.engine.stats())

    def generate(
        self,
        prompts: str | Seq[str] | None = None,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        prompt_token_ids: Seq[Seq[int]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompts is None and prompt_token_ids is None:
            raise ValueError("generate() needs prompts or prompt_token_ids")
        count = len(prompts) if prompts is not None else len(prompt_token_ids)
        if prompts is not None and prompt_token_ids is not None and len(prompt_token_ids) != count:
            raise ValueError("prompts and prompt_token_ids differ in length")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * count
        if len(sampling_params) != count:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {count} prompts")
        ids = []
        try:
            for i in range(count):
                rid = str(next(self._ids))
                self.engine.add_request(
                    rid,
                    prompts[i] if prompts is not None else None,
                    sampling_params[i],
                    list(prompt_token_ids[i]) if prompt_token_ids is not None else None,
                )
                ids.append(rid)
        except ValueError:
            # One refused request refuses the call: none of its requests stay queued.
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        prompts = [
            tok.apply_chat_template(c, tokenize=False, add_generation_prompt=add_generation_prompt)
            for c in conversations
        ]
        # The template already holds the BOS/special tokens: do not add them twice.
        ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(prompts, sampling_params, prompt_token_ids=ids, use_tqdm=use_tqdm)

    def beam_search(
        self, prompts: list[str] | list[list[int]], params: BeamSearchParams
    ) -> list[RequestOutput]:
        sp = params.to_sampling_params()
        if prompts and isinstance(prompts[0], list):
            return self.generate(None, sp, prompt_token_ids=prompts)
        return self.generate(prompts, sp)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            # As vLLM's: requests done, and the generated tokens' rate so far.
            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req", dynamic_ncols=True)
            generated, t0 = 0, time.perf_counter()
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step(finished_only=True):
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            generated += sum(len(c.token_ids) for c in out.outputs)
                            rate = generated / max(time.perf_counter() - t0, 1e-9)
                            bar.set_postfix_str(f"output {rate:,.1f} tok/s", refresh=False)
                            bar.update(1)
        except BaseException:
            # Leave the engine clean (no running requests, no held blocks) for the next call.
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]


def pct(x: float) -> str:
    return f"{100 * x:.1f} %"


class EngineStats(dict):
    """``LLMEngine.stats()``, printed as a few lines a newcomer can read (the dict itself was
    3 KB of keys and histograms)."""

    def __repr__(self) -> str:
        s = self
        queries = s.get("prefix_cache_queries", 0)
        lines = [
            f"KV cache ({s.get('kv_allocation', 'paged')}): "
            f"{s['num_kv_blocks']:,} blocks, {s['num_free_kv_blocks']:,} free "
            f"now; peak {s['peak_kv_blocks_used']:,} used; "
            f"mean utilisation {pct(s['kv_utilization'])}",
            f"  sharing: {s['num_shared_blocks']} shared blocks "
            f"now, {s['num_cow_copies']} copy-on-write copies, "
            f"{pct(s['sharing_savings'])} of table entries saved",
            f"  prefix cache: {s['prefix_cache_hits']:,} of {queries:,} prompt tokens found"
            + (f" ({pct(s['prefix_cache_hits'] / queries)})" if queries else ""),
            f"  preemptions: {s['num_preemptions']} (blocks "
            f"swapped out {s['num_swapped_out_blocks']}, in "
            f"{s['num_swapped_in_blocks']}; swap space {s['num_swap_blocks']:,} blocks)",
            f"tokens: {s['num_prompt_tokens']:,} prompt, {s['num_generation_tokens']:,} generated; "
            f"{s['avg_batched_requests']:.1f} requests per "
            f"step on average over {s['batched_steps']:,} steps",
            f"requests now: {s['num_running']} running, "
            f"{s['num_waiting']} waiting, {s['num_swapped']} swapped",
            "(every number: dict(llm.stats()); the keys as in LLMEngine.stats())",
        ]
        return "\n".join(lines)

    __str__ = __repr__
