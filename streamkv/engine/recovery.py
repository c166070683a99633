"""Resuming requests after the worker processes were restarted.

A restarted worker has an empty KV cache, so each request that was running goes back in as
a new request whose prompt is its own prompt followed by the tokens it had generated
(recompute, the paper's second preemption mode, across a process boundary): the new
request's outputs are relative to that point, and ``splice`` joins them to what came
before so that the stream continues with neither duplicated nor missing text. The worker
still counts outputs from the original prompt (SamplingParams.resumed_output_tokens): a
seeded request's random stream is keyed by output position, and presence / frequency
penalties count outputs only, so both continue where they were. Greedy and seeded requests
continue with the text a fault-free run gives.

Parallel samples (n > 1, best_of > n) are independent draws from one prompt: each sample
still running goes back in as a request of its own, its prompt followed by its own tokens
(``Resumed.parts``, ids ``<request id>#sample-<index>``). It keeps its sample index
(SamplingParams.resumed_sample_index), which keys its seeded stream with the seed and the
output position, so each sample draws what it would have drawn. With prefix caching on,
their common prompt's full blocks are computed once and shared, as any common prefix is.
``Resumed.join`` puts each part's output back in its sample's place, so the request's
outputs read as a fault-free run's (indices, text, token ids, logprobs, finish reasons);
samples that had ended before the restart stay as they were. best_of > n chooses among the
samples only once all have ended, by the engine's own rule (sequence.best_of_n), with each
sample's cumulative logprob carried over the restart.

Beam search starts over: its beams' tokens and cumulative logprobs are in its last output,
but the hypotheses that had ended (kept for the final ranking: SequenceGroup.finished_beams)
and whether the running beams can still beat them (beam_state) are engine state that no
output carries, and a beam search group starts from one sequence; continuing from the live
beams alone could return another answer. Beam search is deterministic (temperature 0) and
never streamed, so running it again from its prompt gives the answer of a fault-free run, at
the cost of the decode steps it had made. So does a request of several samples that had no
token yet.

Stop strings: one wholly before the restart point ended the request before it; one wholly
after is found by the resumed request itself. One that straddles the point (begun before,
completed after) is seen by neither, so ``splice`` looks for it in the joined text, and
holds back, as the detokenizer does, the end of the text that could still begin one (the
text before the restart included: its held-back tail was never streamed). When it finds
one, the spliced output is finished while the resumed request is not: the caller aborts
that request (``ends_early``, ``Resumed.join``). Known gap: text generated up to the restart
is decoded once, in the context of the last 6 prompt tokens as the detokenizer does.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from streamkv.engine.detokenizer import find_stop, holdback
from streamkv.sampling_params import SamplingParams
from streamkv.sequence import CompletionOutput, Logprob, RequestOutput, best_of_n

_CONTEXT = 6  # prompt tokens decoded with the first output tokens (engine/detokenizer.py)


class EngineRestartedError(RuntimeError):
    """The engine was restarted after a stall and this request, a suspect, was ended (the
    others resume)."""


@dataclass(slots=True)
class ResumeBase:
    """What a resumed request (or sample) had produced before the restart."""

    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float
    stops: list[str] = dataclasses.field(default_factory=list)  # the request's stop strings
    include_stop: bool = False  # include_stop_str_in_output


@dataclass(slots=True)
class Part:
    """A request the new engine runs for a resumed one: the request itself, or one sample."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class Resumed:
    """A resumed request: its newest output before the restart, and its parts (part id -> its
    sample's index and base). ``join`` builds the request's outputs from theirs."""

    last: RequestOutput
    params: SamplingParams  # as submitted
    parts: dict[str, tuple[int, ResumeBase]] = dataclasses.field(default_factory=dict)
    running: set[str] = dataclasses.field(default_factory=set)  # the parts that have not ended
    samples: dict[int, CompletionOutput] = dataclasses.field(
        default_factory=dict
    )  # by index, newest

    def join(self, out: RequestOutput) -> tuple[RequestOutput | None, list[str]]:
        """The request's output once its part ``out.request_id`` reported ``out`` (None: that
        part had ended, ``out`` is stale), and the parts the caller aborts: one that a stop
        string straddling the restart ended, all of them when one failed."""
        if out.request_id not in self.running:
            return None, []
        index, base = self.parts[out.request_id]
        spliced = splice(base, out)
        self.samples[index] = dataclasses.replace(spliced.outputs[0], index=index)
        aborts = [out.request_id] if ends_early(out, spliced) else []
        if spliced.finished:
            self.running.discard(out.request_id)
        if out.error is not None:  # a failed step ends the whole request, as in the engine
            for part_id in self.running:
                i = self.parts[part_id][0]
                self.samples[i] = dataclasses.replace(self.samples[i], finish_reason="abort")
                aborts.append(part_id)
            self.running.clear()
        finished = not self.running
        samples = list(self.samples.values())  # in sample order, as the engine lists them
        if finished:
            if self.params.best_of > self.params.n:
                samples = best_of_n(samples, self.params.n)
            samples = [dataclasses.replace(c, index=i) for i, c in enumerate(samples)]
        last = self.last
        return RequestOutput(
            last.request_id,
            last.prompt,
            last.prompt_token_ids,
            samples,
            finished,
            out.error,
            {**out.metrics, **last.metrics},
            last.prompt_logprobs,
        ), aborts


def resume(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    last: RequestOutput | None,
    tokenizer: Any,
    taken: Container[str] = (),
) -> tuple[list[Part], Resumed | None]:
    """What goes into the new engine for a request whose newest output was ``last`` (None if
    it had none), and the ``Resumed`` that joins their outputs; None when the request starts
    over as submitted (no token yet, or beam search). ``taken``: request ids in use."""
    if last is None or params.use_beam_search or not any(c.token_ids for c in last.outputs):
        return [Part(request_id, prompt_token_ids, params)], None
    resumed = Resumed(last, params, samples={c.index: c for c in last.outputs})
    parts = []
    for c in last.outputs:
        if c.finish_reason is not None:
            continue
        ids, part_params, base = _resume_sample(prompt_token_ids, params, last.prompt, c, tokenizer)
        part_id = request_id
        if params.best_of > 1:
            part_id = f"{request_id}#sample-{c.index}"
            while part_id in taken:
                part_id += "+"
            part_params = dataclasses.replace(
                part_params, n=1, best_of=1, resumed_sample_index=c.index
            )
        resumed.parts[part_id] = (c.index, base)
        resumed.running.add(part_id)
        parts.append(Part(part_id, ids, part_params))
    return parts, resumed


def _resume_sample(
    prompt_token_ids: list[int],
    params: SamplingParams,
    prompt: str | None,
    c: CompletionOutput,
    tokenizer: Any,
) -> tuple[list[int], SamplingParams, ResumeBase]:
    """The prompt and parameters that continue sample ``c``, and the base that ``splice``
    adds back."""
    done = len(c.token_ids)
    # Prompt logprobs came with the first outputs (Resumed.last has them): none for the part.
    changes: dict = {
        "min_tokens": max(0, params.min_tokens - done),
        "prompt_logprobs": None,
        "resumed_output_tokens": params.resumed_output_tokens + done,
    }
    if params.max_tokens is not None:
        changes["max_tokens"] = max(1, params.max_tokens - done)
    text = c.text
    if tokenizer is not None:
        # The whole generated text: ``c.text`` may lack a tail held back for stop strings.
        context = prompt_token_ids[-_CONTEXT:]
        skip = params.skip_special_tokens
        head = tokenizer.decode(context, skip_special_tokens=skip)
        text = tokenizer.decode(context + list(c.token_ids), skip_special_tokens=skip)[len(head) :]
    base = ResumeBase(
        prompt,
        prompt_token_ids,
        list(c.token_ids),
        text,
        list(c.logprobs) if c.logprobs is not None else None,
        c.cumulative_logprob,
        list(params.stop or []),
        params.include_stop_str_in_output,
    )
    return prompt_token_ids + list(c.token_ids), dataclasses.replace(params, **changes), base


def splice(base: ResumeBase, out: RequestOutput) -> RequestOutput:
    """``out`` of the resumed request, as the original request would have reported it."""
    outputs, finished = [], out.finished
    for c in out.outputs:
        logprobs = (
            base.logprobs + c.logprobs
            if base.logprobs is not None and c.logprobs is not None
            else c.logprobs
        )
        text, finish_reason, stop_reason = base.text + c.text, c.finish_reason, c.stop_reason
        if base.stops:
            # A straddling stop completes within the first len(stop) - 1 new characters, before
            # any stop the resumed request found after them (its text is cut there).
            hit = find_stop(text, base.stops, len(base.text))
            if hit is not None and hit[0] < len(base.text):  # it straddles the restart point
                i, stop = hit
                text = text[: i + len(stop) if base.include_stop else i]
                finish_reason, stop_reason, finished = "stop", stop, True
            elif c.finish_reason is None:
                text = text[: len(text) - holdback(text, base.stops)]
        outputs.append(
            CompletionOutput(
                c.index,
                text,
                base.token_ids + c.token_ids,
                base.cumulative_logprob + c.cumulative_logprob,
                logprobs,
                finish_reason,
                stop_reason,
            )
        )
    return dataclasses.replace(
        out,
        prompt=base.prompt,
        prompt_token_ids=base.prompt_token_ids,
        outputs=outputs,
        finished=finished,
    )


def ends_early(engine_out: RequestOutput, spliced: RequestOutput) -> bool:
    """A stop string straddling the restart ended the request that the engine still runs:
    the caller aborts it there."""
    return spliced.finished and not engine_out.finished


@dataclass(slots=True)
class RestartBudget:
    """At most ``limit`` restarts in ``window`` seconds: a worker that dies again at once (a
    request that crashes it, a device that is gone) ends the server instead of looping."""

    limit: int = 3
    window: float = 300.0
    _times: deque = dataclasses.field(default_factory=deque)

    def take(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        while self._times and now - self._times[0] > self.window:
            self._times.popleft()
        if len(self._times) >= self.limit:
            return False
        self._times.append(now)
        return True
