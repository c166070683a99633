"""The offline API, with vLLM's names: ``LLM(...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from streamkv.engine.llm_engine import LLMEngine
from streamkv.entrypoints.args import engine_config
from streamkv.sampling_params import BeamSearchParams, SamplingParams
from streamkv.sequence import RequestOutput

__all__ = ["LLM", "engine_config"]


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        """``kwargs`` are the engine arguments: the config dataclasses' field names
        (entrypoints/args.py; the same as the command's flags)."""
        self.engine = LLMEngine(engine_config(model, **kwargs))
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the worker processes (if any) now, rather than at interpreter exit."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> dict:
        return self.engine.stats()

    def generate(
        self,
        prompts: str | Seq[str] | None = None,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        prompt_token_ids: Seq[Seq[int]] | None = None,
        use_tqdm: bool = False,
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
        use_tqdm: bool = False,
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

    def beam_search(self, prompts: list[str] | list[list[int]], params: BeamSearchParams) -> list[RequestOutput]:
        sp = params.to_sampling_params()
        if prompts and isinstance(prompts[0], list):
            return self.generate(None, sp, prompt_token_ids=prompts)
        return self.generate(prompts, sp)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="requests")
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step(finished_only=True):
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
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
