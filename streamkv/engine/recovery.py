"""Resuming requests after the worker processes were restarted.

A restarted worker has an empty KV cache, so each request that was running goes back in as
a new request whose prompt is its own prompt followed by the tokens it had generated
(recompute, the paper's second preemption mode, across a process boundary): the new
request's outputs are relative to that point, and ``splice`` joins them to what came
before so that the stream continues with neither duplicated nor missing text. The worker
still counts outputs from the original prompt (SamplingParams.resumed_output_tokens): a
seeded request's random stream is keyed by output position, and presence / frequency
penalties count outputs only, so both continue where they were.

What cannot resume: parallel samples (n > 1, best_of > n) and beam search, whose
sequences are chosen among each other; they end with an error. Greedy and seeded requests
continue with the text a fault-free run gives.

Stop strings: one wholly before the restart point ended the request before it; one wholly
after is found by the resumed request itself. One that straddles the point (begun before,
completed after) is seen by neither, so ``splice`` looks for it in the joined text, and
holds back, as the detokenizer does, the end of the text that could still begin one (the
text before the restart included: its held-back tail was never streamed). When it finds
one, the spliced output is finished while the resumed request is not: the caller aborts
that request (``ends_early``). Known gap: text generated up to the restart is decoded once,
in the context of the last 6 prompt tokens as the detokenizer does.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass

from streamkv.engine.detokenizer import find_stop, holdback
from streamkv.sampling_params import SamplingParams
from streamkv.sequence import CompletionOutput, Logprob, RequestOutput

_CONTEXT = 6  # prompt tokens decoded with the first output tokens (engine/detokenizer.py)


class EngineRestartedError(RuntimeError):
    """The workers were restarted and this request could not be resumed."""


@dataclass(slots=True)
class ResumeBase:
    """What a resumed request had produced before the restart."""

    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float
    stops: list[str] = dataclasses.field(default_factory=list)  # the request's stop strings
    include_stop: bool = False  # include_stop_str_in_output


def resumable(params: SamplingParams) -> bool:
    return params.n == 1 and params.best_of == 1 and not params.use_beam_search


def resume_request(prompt_token_ids: list[int], params: SamplingParams, last: RequestOutput | None,
                   tokenizer) -> tuple[list[int], SamplingParams, ResumeBase | None]:
    """The prompt and parameters that continue a request from ``last`` (its newest output,
    None if it had none yet), and the base that ``splice`` adds back."""
    if last is None or not last.outputs or not last.outputs[0].token_ids:
        return prompt_token_ids, params, None
    c = last.outputs[0]
    done = len(c.token_ids)
    changes: dict = {"min_tokens": max(0, params.min_tokens - done),
                     "resumed_output_tokens": params.resumed_output_tokens + done}
    if params.max_tokens is not None:
        changes["max_tokens"] = max(1, params.max_tokens - done)
    text = c.text
    if tokenizer is not None:
        # The whole generated text: ``c.text`` may lack a tail held back for stop strings.
        context = prompt_token_ids[-_CONTEXT:]
        skip = params.skip_special_tokens
        head = tokenizer.decode(context, skip_special_tokens=skip)
        text = tokenizer.decode(context + list(c.token_ids), skip_special_tokens=skip)[len(head):]
    base = ResumeBase(last.prompt, prompt_token_ids, list(c.token_ids), text,
                      list(c.logprobs) if c.logprobs is not None else None, c.cumulative_logprob,
                      list(params.stop or []), params.include_stop_str_in_output)
    return prompt_token_ids + list(c.token_ids), dataclasses.replace(params, **changes), base


def splice(base: ResumeBase, out: RequestOutput) -> RequestOutput:
    """``out`` of the resumed request, as the original request would have reported it."""
    outputs, finished = [], out.finished
    for c in out.outputs:
        logprobs = base.logprobs + c.logprobs if base.logprobs is not None and c.logprobs is not None else c.logprobs
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
        outputs.append(CompletionOutput(
            c.index, text, base.token_ids + c.token_ids,
            base.cumulative_logprob + c.cumulative_logprob, logprobs, finish_reason, stop_reason,
        ))
    return dataclasses.replace(out, prompt=base.prompt, prompt_token_ids=base.prompt_token_ids, outputs=outputs,
                               finished=finished)


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
