"""Chat completion choices, whole or as stream deltas, for each ``tool_choice`` mode.

- ``none``: the text is the message's content.
- ``auto``: Hermes-style ``<tool_call>`` blocks in the text become ``tool_calls``
  (tool_calls.py); streamed, a call leaves as one ``tool_calls`` delta once its block closes,
  and the text of a call never leaves as content. ``finish_reason`` is ``tool_calls`` when the
  model called a tool and stopped by itself.
- named: the forced output is the arguments object; the call opens with its id and name and
  the arguments stream as they come. ``finish_reason`` stays ``stop``, as OpenAI's does.
- ``required``: the forced output is a JSON array of calls, sent whole when it is complete
  (streamed: in the choice's last chunk).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from streamkv.entrypoints.openai.requests import ChatCompletionRequest
from streamkv.entrypoints.openai.streaming import ChoiceState, LogprobFormatter, deltas
from streamkv.entrypoints.openai.tool_calls import (
    HermesStream,
    parse_hermes,
    parse_required,
    tool_call,
)
from streamkv.sequence import CompletionOutput, RequestOutput


@dataclass(slots=True)
class ChatOutput:
    choices: list[dict]
    num_tokens: int


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _finish(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


class ChatResponder:
    def __init__(self, req: ChatCompletionRequest, fmt: LogprobFormatter, top: int | None) -> None:
        self.req, self.fmt, self.top = req, fmt, top
        self.mode = req.tool_mode()
        named = req.named_tool()
        self.name = named.function.name if named is not None else None
        last = req.messages[-1]
        self.echo = (last.text() or "") if req.echo and last.role == "assistant" else ""

    def _logprobs(self, token_ids: list[int], lps) -> dict | None:
        return self.fmt.chat_logprobs(token_ids, lps, self.top) if self.top is not None else None

    # -- whole ----------------------------------------------------------------------------
    def message(self, c: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        calls: list[dict] | None = None
        content: str | None = c.text
        if self.mode == "auto":
            content, calls = parse_hermes(c.text, self.req.parallel_tool_calls)
        elif self.mode == "named":
            # Cut off by max_tokens, the arguments are not JSON: no call, as in vLLM.
            cut = c.finish_reason == "length" and not _is_json(c.text)
            content, calls = (c.text, None) if cut else ("", [tool_call(self.name, c.text)])
        elif self.mode == "required":
            calls = parse_required(c.text)
            content = "" if calls or c.finish_reason == "length" else c.text
        if self.echo:  # vLLM's chat echo: the continued turn comes back whole
            content = self.echo + (content or "")
        # vLLM's message: every key present (null, or [] without calls).
        msg: dict[str, Any] = {
            "role": "assistant",
            "content": content,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": calls or [],
            "reasoning_content": None,
        }
        return msg, c.finish_reason if self.mode == "named" else _finish(
            c.finish_reason, bool(calls)
        )

    def whole(self, out: RequestOutput) -> ChatOutput:
        choices = []
        for c in out.outputs:
            msg, finish = self.message(c)
            choices.append(
                {
                    "index": c.index,
                    "message": msg,
                    "logprobs": self._logprobs(c.token_ids, c.logprobs),
                    "finish_reason": finish,
                    "stop_reason": c.stop_reason,
                    "token_ids": c.token_ids if self.req.return_token_ids else None,
                }
            )
        return ChatOutput(choices, sum(len(c.token_ids) for c in out.outputs))

    # -- streamed -------------------------------------------------------------------------
    def opening(self, states: list[ChoiceState]) -> list[dict]:
        return [
            {
                "index": st.index,
                "delta": {"role": "assistant", "content": self.echo},
                "logprobs": None,
                "finish_reason": None,
            }
            for st in states
        ]

    def stream_choices(
        self, states: list[ChoiceState]
    ) -> Callable[[int, RequestOutput], Iterator[dict]]:
        parsers = [HermesStream(self.req.parallel_tool_calls) for _ in states]
        texts = ["" for _ in states]
        n = len(states)

        def choices(_: int, out: RequestOutput) -> Iterator[dict]:
            for d in deltas(states, 0, n, out):
                k, done = d.choice.index, d.finish_reason is not None
                delta, called = self._delta(k, d.text, d.finish_reason, d.choice, parsers[k], texts)
                if not delta and not done and self.top is None and not self.req.return_token_ids:
                    continue
                if (
                    done and "content" not in delta
                ):  # vLLM's last chunk: clients concatenate content
                    delta["content"] = ""
                choice = {
                    "index": k,
                    "delta": delta,
                    "logprobs": self._logprobs(d.token_ids, d.logprobs),
                    "finish_reason": d.finish_reason
                    if self.mode == "named"
                    else _finish(d.finish_reason, called),
                }
                if done:
                    choice["stop_reason"] = d.stop_reason
                if self.req.return_token_ids:
                    choice["token_ids"] = d.token_ids
                yield choice

        return choices

    def _delta(
        self,
        k: int,
        text: str,
        finish: str | None,
        st: ChoiceState,
        parser: HermesStream,
        texts: list[str],
    ) -> tuple[dict, bool]:
        """This choice's delta for ``text``, and whether it has called a tool."""
        done = finish is not None
        if self.mode == "auto":
            content = parser.feed(text) + (parser.finish() if done else "")
            delta: dict[str, Any] = {"content": content} if content else {}
            fresh = parser.new_calls()
            if fresh:
                delta["tool_calls"] = [{"index": i, **call} for i, call in fresh]
            return delta, bool(parser.calls)
        if self.mode == "named":
            if not text:
                return {}, True
            if st.started:
                return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}, True
            st.started = True
            return {"tool_calls": [{"index": 0, **tool_call(self.name, text)}]}, True
        if self.mode == "required":
            texts[k] += text
            if not done:
                return {}, False
            calls = parse_required(texts[k])
            if calls is None:  # cut off by max_tokens: no call, no content (vLLM's answer)
                return {"content": "" if finish == "length" else texts[k]}, False
            return {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}, True
        return ({"content": text} if text else {}), False
