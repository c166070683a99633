"""The synchronous engine: add_request / step / abort. One step is three calls —
schedule, execute, postprocess."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from pathlib import Path

from streamkv.config import EngineConfig
from streamkv.core.admission import InvalidParameter, Limits, check_request  # noqa: F401 - re-exported
from streamkv.core.contiguous import create_block_manager
from streamkv.core.scheduler import Scheduler, SchedulerOutput
from streamkv.engine import prompt_logprobs
from streamkv.engine.beam_search import BeamState
from streamkv.engine.detokenizer import Detokenizer
from streamkv.engine.output_processor import OutputProcessor
from streamkv.engine.stats import EngineStats
from streamkv.engine.step_builder import StepBuilder
from streamkv.engine.structured import StructuredOutputManager
from streamkv.executor.base import Executor, create_executor
from streamkv.messages import StepFailed, StepOutput
from streamkv.model_info import ModelInfo
from streamkv.models.loader import load_tokenizer, resolve_model_dir, resolve_model_info
from streamkv.sampling_params import SamplingParams
from streamkv.sequence import RequestOutput, Sequence, SequenceGroup

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class EngineInfo:
    """What a front end needs to know about the engine, fixed once the model is loaded."""

    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    num_swap_blocks: int
    usable_kv_blocks: int  # the pool minus the scheduler's watermark
    max_num_seqs: int
    prefix_caching: bool


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor | None = None,
                 model_info: ModelInfo | None = None) -> None:
        config.verify()
        # The model's facts, once: the executor and its workers get this record, not a path
        # to re-read. Tensor-parallel sizes are checked here from config numbers, before any
        # worker process starts.
        model_dir = model_info.model_dir if model_info is not None else resolve_model_dir(config.model.model)
        self.tokenizer = load_tokenizer(Path(config.model.tokenizer).expanduser() if config.model.tokenizer else model_dir)
        self.model_info = info = model_info or resolve_model_info(config.model, model_dir, self.tokenizer)
        info.verify_tensor_parallel(config.model.tensor_parallel_size)
        # The engine's own copy carries the served context length; the caller's config is
        # never changed after verify().
        self.config = config = dataclasses.replace(
            config, scheduler=dataclasses.replace(config.scheduler, max_model_len=info.max_model_len)
        )
        owned = executor is None
        self.executor = executor = create_executor(config, info) if owned else executor
        try:
            self._setup(config, executor)
        except BaseException:
            if owned:  # worker processes must not outlive a failed start
                executor.shutdown()
            raise

    def _setup(self, config: EngineConfig, executor: Executor) -> None:
        info = self.model_info
        num_device, num_cpu = executor.num_available_blocks()
        if num_device < 1:
            raise ValueError("no memory left for the KV cache; lower the model size or raise the memory budget")
        executor.init_cache(num_device, num_cpu)
        self.block_manager = bm = create_block_manager(config.cache, num_device, num_cpu, info.max_model_len)
        self.scheduler = Scheduler(config.scheduler, bm)
        self.limits = Limits(
            max_model_len=info.max_model_len, vocab_size=info.vocab_size, block_size=config.cache.block_size,
            usable_blocks=bm.device.num_blocks - bm.watermark_blocks, max_num_seqs=config.scheduler.max_num_seqs,
        )
        self.eos_token_ids = info.eos_token_ids
        self.structured = StructuredOutputManager(self.tokenizer, info.vocab_size, self.eos_token_ids)
        self.step_builder = StepBuilder(bm.tables, self.eos_token_ids)  # what the workers hold
        self.detokenizer = Detokenizer(self.tokenizer) if self.tokenizer is not None else None
        self._seq_ids = itertools.count()
        self.outputs = OutputProcessor(
            bm, self.scheduler.free_finished_seqs, self.new_seq_id, info.max_model_len,
            self.detokenizer, self.eos_token_ids,
        )
        self.stats_ = EngineStats(bm, self.scheduler, info.max_model_len)
        self.groups: dict[str, SequenceGroup] = {}
        logger.info("KV cache: %d device blocks, %d CPU swap blocks of %d tokens", num_device, num_cpu, config.cache.block_size)

    # -- requests -----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
    ) -> None:
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("either prompt or prompt_token_ids is required")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        check_request(prompt_token_ids, params, self.limits)
        params.check_max_logprobs(self.config.model.max_logprobs)
        self.structured.admit(params)  # compiles (cached) or refuses the grammar
        seq = Sequence(next(self._seq_ids), list(prompt_token_ids))
        seq.grammar = self.structured.new_grammar(params)
        group = SequenceGroup(request_id, [seq], params, prompt=prompt)
        prompt_logprobs.prepare(group, seq, params)
        if params.use_beam_search:
            group.beam_state = BeamState()
        if arrival_time is not None:
            group.arrival_time = arrival_time
        self.groups[request_id] = group
        self.scheduler.add(group)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        group = self.scheduler.abort(request_id)
        self.groups.pop(request_id, None)
        return self.outputs.make_output(group) if group is not None else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def new_seq_id(self) -> int:
        return next(self._seq_ids)

    # -- a narrow view for front ends (AsyncEngine): no scheduler or block-manager internals
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def info(self) -> EngineInfo:
        bm = self.block_manager
        return EngineInfo(
            max_model_len=self.model_info.max_model_len,
            vocab_size=self.model_info.vocab_size,
            block_size=bm.block_size,
            num_kv_blocks=bm.device.num_blocks,
            num_swap_blocks=bm.cpu.num_blocks,
            usable_kv_blocks=self.limits.usable_blocks,
            max_num_seqs=self.config.scheduler.max_num_seqs,
            prefix_caching=self.config.cache.enable_prefix_caching,
        )

    # -- the step -----------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One iteration. Returns an output for every request the step touched, or with
        ``finished_only`` for those that finished (what offline generation keeps: it skips
        building a snapshot of every running request on every step)."""
        sched = self.scheduler.schedule()
        try:
            result = self.executor.execute(self.step_builder.build(sched)) if not sched.is_empty else StepOutput()
        except StepFailed as e:
            return self._fail_step(sched, e)
        outputs = self.outputs.process(sched, result, finished_only)
        self.stats_.record_step(sched)
        for out in outputs:
            if out.finished:
                self.groups.pop(out.request_id, None)
        return outputs

    def _fail_step(self, sched: SchedulerOutput, error: StepFailed) -> list[RequestOutput]:
        """The worker could not run this step: its requests end with the error (their blocks
        freed); requests outside the step, and later steps, go on."""
        failed = {s.group.request_id: s.group for s in sched.scheduled}
        logger.error("a step failed; ending its %d request(s): %s", len(failed), error)
        for request_id, group in failed.items():
            self.scheduler.abort(request_id)
            group.error = f"the step failed: {error}"
        outputs = []
        for group in [*failed.values(), *sched.failed]:
            if group.finished_time is None:
                group.finished_time = time.monotonic()
            outputs.append(self.outputs.make_output(group))
            self.groups.pop(group.request_id, None)
        return outputs

    def stats(self) -> dict:
        return self.stats_.as_dict()

    def shutdown(self) -> None:
        self.executor.shutdown()

