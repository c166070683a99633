"""The engine: add_request / step / abort. One step is three calls: schedule, execute,
process; with async scheduling the step pipeline (engine/step_pipeline.py) overlaps them."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Container
from pathlib import Path

from streamkv.config import EngineConfig
from streamkv.core.admission import EngineLimits, InvalidParameter, check_request
from streamkv.core.block_manager import create_block_manager
from streamkv.core.block_pool import root_key
from streamkv.core.preemption import device_profile
from streamkv.core.scheduler import Scheduler
from streamkv.core.step_plan import SchedulerOutput
from streamkv.engine import prompt_logprobs
from streamkv.engine.beam_search import BeamState, ending_tokens
from streamkv.engine.detokenizer import Detokenizer
from streamkv.engine.output_processor import OutputProcessor
from streamkv.engine.stats import EngineStats
from streamkv.engine.step_builder import StepBuilder
from streamkv.engine.step_pipeline import InFlight, StepPipeline
from streamkv.engine.structured import StructuredOutputManager
from streamkv.executor.base import Executor, create_executor
from streamkv.messages import StepFailed, StepOutput
from streamkv.models.loader import load_tokenizer, resolve_model_dir, resolve_model_info
from streamkv.sampling_params import SamplingParams
from streamkv.sequence import RequestOutput, Sequence, SequenceGroup

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        config.verify()
        # The model's facts, once: the executor and its workers get this record, not a path
        # to re-read. Tensor-parallel sizes are checked here from config numbers, before any
        # worker process starts.
        model_dir = resolve_model_dir(config.model.model)
        self.tokenizer = load_tokenizer(
            Path(config.model.tokenizer).expanduser() if config.model.tokenizer else model_dir
        )
        self.model_info = info = resolve_model_info(config.model, model_dir, self.tokenizer)
        info.verify_tensor_parallel(config.model.tensor_parallel_size)
        # The engine's own copy carries the resolved device ("auto" decided once, here) and
        # the scheduler's defaults for it; the caller's config is never changed after verify().
        from streamkv.worker.worker import device_memory, resolve_device

        device = resolve_device(config.model.device)
        self.device_type = device.type
        self.config = config = dataclasses.replace(
            config,
            model=dataclasses.replace(config.model, device=str(device)),
            scheduler=config.scheduler.on_device(device.type, device_memory(device)),
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
            raise ValueError(
                "no memory left for the KV cache; lower the model size or raise the memory budget"
            )
        executor.init_cache(num_device, num_cpu)
        self.block_manager = bm = create_block_manager(
            config.cache, num_device, num_cpu, info.max_model_len
        )
        sched = config.scheduler
        if sched.preemption_cost_profile is None:  # auto preemption's costs, for this device
            profile = device_profile(self.device_type)
            sched = dataclasses.replace(sched, preemption_cost_profile=profile)
        self.scheduler = Scheduler(sched, bm)
        self.limits = EngineLimits(
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            block_size=bm.block_size,
            num_kv_blocks=bm.device.num_blocks,
            num_swap_blocks=bm.cpu.num_blocks,
            usable_kv_blocks=bm.device.num_blocks - bm.watermark_blocks,
            max_num_seqs=config.scheduler.max_num_seqs,
            prefix_caching=config.cache.enable_prefix_caching,
        )
        self._setup_step_parts()
        self.groups: dict[str, SequenceGroup] = {}
        # Async scheduling needs workers that fill pending input tokens on the device.
        self.async_scheduling = sched.async_scheduling and executor.resolves_pending_tokens
        self.pipeline = None
        if self.async_scheduling:
            self.pipeline = StepPipeline(
                self._launch,
                self._apply,
                self._build,
                self.outputs.advance,
                self.structured,
                sched.overlap_structured,
            )
        blocks = (num_device, num_cpu, config.cache.block_size)
        logger.info("KV cache: %d device blocks, %d CPU swap blocks of %d tokens", *blocks)

    def _setup_step_parts(self) -> None:
        """What a step passes through around the scheduler: inputs, grammars, outputs, stats."""
        info, bm = self.model_info, self.block_manager
        self.eos_token_ids = info.eos_token_ids
        self.structured = StructuredOutputManager(
            self.tokenizer, info.vocab_size, info.eos_token_ids
        )
        self.step_builder = StepBuilder(bm.tables, self.eos_token_ids)  # what the workers hold
        self.detokenizer = Detokenizer(self.tokenizer) if self.tokenizer is not None else None
        self._seq_ids = itertools.count()
        self.outputs = OutputProcessor(
            bm,
            self.scheduler.free_finished_seqs,
            self.new_seq_id,
            info.max_model_len,
            self.detokenizer,
            self.eos_token_ids,
        )
        self.stats_ = EngineStats(bm, self.scheduler, info.max_model_len)

    # -- requests -----------------------------------------------------------------------
    def defer_until_compiled(self, params: SamplingParams, resume: Callable[[], None]) -> bool:
        """True when ``params``' grammar compiles now on a compile thread: ``add_request``
        waits for ``resume`` (the engine thread never compiles a grammar: issue 26)."""
        return params.structured_outputs is not None and self.structured.defer(params, resume)

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
        allowed = set(params.allowed_token_ids or ())
        if params.min_tokens and allowed and allowed <= ending_tokens(params, self.eos_token_ids):
            # min_tokens bans them at first: no token at all could be sampled.
            raise InvalidParameter(
                "allowed_token_ids",
                "allowed_token_ids holds only tokens that end the "
                "output, which min_tokens bans for the first tokens.",
            )
        params.check_max_logprobs(self.config.model.max_logprobs)
        grammar = None
        if params.structured_outputs is not None:  # compiles (cached) or refuses it
            grammar = self.structured.new_grammar(params)
        seq = Sequence(
            next(self._seq_ids),
            list(prompt_token_ids),
            params.resumed_sample_index,
            cache_root=root_key(params.cache_salt),
        )
        seq.grammar = grammar
        if grammar is not None and params.resumed_output_tokens:
            # A request resumed after a restart: its grammar stands where the outputs before
            # the restart (now the prompt's tail) left it, not at its start.
            for token in prompt_token_ids[len(prompt_token_ids) - params.resumed_output_tokens :]:
                seq.grammar.accept(token)
        group = SequenceGroup(request_id, [seq], params, prompt=prompt)
        if params.prompt_logprobs is not None:
            prompt_logprobs.prepare(group, seq)
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

    def reset_prefix_cache(self) -> None:
        """Forget the cached prompt blocks that no request holds (vLLM's name)."""
        self.block_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        # A step in flight counts: its outputs are still to be processed (async scheduling).
        live = self.pipeline is not None and self.pipeline.has_live_step()
        return self.scheduler.has_unfinished() or live

    @property
    def overlapped_steps(self) -> int:
        """Steps whose successor was submitted before their outputs were read."""
        return self.pipeline.overlapped_steps if self.pipeline is not None else 0

    def new_seq_id(self) -> int:
        return next(self._seq_ids)

    # -- a narrow view for front ends (AsyncEngine): no scheduler or block-manager internals
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def info(self) -> EngineLimits:
        return self.limits

    # -- the step -----------------------------------------------------------------------
    def step(
        self,
        finished_only: bool = False,
        unread: Container[str] = (),
        emit: Callable[[list[RequestOutput]], None] | None = None,
    ) -> list[RequestOutput]:
        """One iteration, three calls: schedule and submit a step (``_launch``), apply its
        samples (``_apply``), build the outputs of the requests it touched (``_build``): with
        ``finished_only`` only finished ones (offline generation), and none of running ones in
        ``unread`` (the server has not read their last output). With async scheduling the step
        pipeline makes the same calls overlapped, handing a step's outputs to ``emit`` if
        given (engine/step_pipeline.py)."""
        if self.pipeline is not None:
            return self.pipeline.step(finished_only, unread, emit)
        step = self._launch()
        touched = self._apply(step)
        return self._build(touched, finished_only, unread)

    def _launch(self) -> InFlight:
        """Schedule a step and hand it to the executor."""
        started = time.monotonic()  # the requests' first-scheduled time (engine/stats.py)
        sched = self.scheduler.schedule()
        step = InFlight(sched, started)
        if not sched.is_empty:
            inputs = self.step_builder.build(sched)
            try:
                step.handle = self.executor.submit(inputs)
            except StepFailed as e:
                step.error = e
        return step

    def _apply(self, step: InFlight, advanced: bool = False) -> list[SequenceGroup]:
        """Wait for a step's samples and apply them; the requests it touched."""
        sched = step.sched
        try:
            if step.error is not None:
                raise step.error
            result = step.handle.result() if step.handle is not None else StepOutput()
        except StepFailed as e:
            return self._fail_step(sched, e)
        touched = self.outputs.apply(sched, result, advanced)
        self.stats_.record_step(sched, step.started)
        return touched

    def _build(
        self, touched: list[SequenceGroup], finished_only: bool, unread: Container[str] = ()
    ) -> list[RequestOutput]:
        """The outputs of requests a step touched (``_apply``), built at once or after the
        next step was submitted; a request answered in between (aborted) is skipped."""
        groups = self.groups
        outputs = self.outputs.build(
            [g for g in touched if groups.get(g.request_id) is g], finished_only, unread
        )
        for out in outputs:
            if out.finished:
                del groups[out.request_id]
        return outputs

    def _fail_step(self, sched: SchedulerOutput, error: StepFailed) -> list[SequenceGroup]:
        """The worker could not run this step: its unfinished requests end with the error
        (blocks freed); the rest, and later steps, go on. Returns the requests to answer."""
        failed = {s.group.request_id: s.group for s in sched.scheduled if not s.group.finished}
        for s in sched.scheduled:
            s.seq.num_pending = 0
        logger.error("a step failed; ending its %d request(s): %s", len(failed), error)
        for request_id, group in failed.items():
            self.scheduler.abort(request_id)
            group.error = f"the step failed: {error}"
        ended = [*failed.values(), *sched.failed]
        for group in ended:
            if group.finished_time is None:
                group.finished_time = time.monotonic()
        return ended

    def stats(self) -> dict:
        return self.stats_.as_dict()

    def shutdown(self) -> None:
        """Stop the workers and free their device memory (a step in flight is dropped)."""
        if self.pipeline is not None:
            self.pipeline.drop()
        self.structured.shutdown()
        self.executor.shutdown()
