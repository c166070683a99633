"""Chat messages (and tools) → the prompt's token ids, through the model's chat template.

A template that knows tools (its source mentions them, as Qwen2's and Llama 3.1's do) gets
them natively: ``tools=`` and messages with ``tool_calls`` (arguments as objects) and the
``tool`` role. Other templates (the embedded SmolLM2's) get the documented Hermes-style
fallback, plain text that any template renders:
- the offered tools: a system message listing them in ``<tools></tools>`` and asking for
  ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (appended to the first system
  message, or a new first message);
- an assistant turn's ``tool_calls``: the same ``<tool_call>`` blocks after its content;
- ``tool`` turns: a user turn of ``<tool_response></tool_response>`` blocks (consecutive
  ones merged, so that user and assistant turns still alternate).
"""

from __future__ import annotations

import json
from typing import Any

from streamkv.entrypoints.openai.chat_messages import ChatMessage, Tool
from streamkv.entrypoints.openai.errors import APIError
from streamkv.entrypoints.openai.tool_calls import CLOSE, OPEN

_TOOLS_PROMPT = (
    "You can call functions to help with the user's request. The functions are described as "
    "JSON schemas inside <tools></tools>:\n<tools>\n{tools}\n</tools>\nTo call one, answer with "
    'a JSON object {{"name": <function name>, "arguments": <arguments object>}} inside '
    "<tool_call></tool_call> tags, one block per call."
)


# apply_chat_template's own parameters (and the template's messages): chat_template_kwargs
# adds template variables, it does not get to switch tokenization or swap the template.
_RESERVED_KWARGS = frozenset(
    (
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    )
)


def check_template_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``chat_template_kwargs``: extra variables the template may read (Qwen3's
    ``enable_thinking``, say); a template ignores those it does not use."""
    taken = sorted(k for k in kwargs if k in _RESERVED_KWARGS or not k.isidentifier())
    if taken:
        raise ValueError(f"may not set {', '.join(map(repr, taken))} (not a template variable)")
    return kwargs


def knows_tools(tok) -> bool:
    template = getattr(tok, "chat_template", None)
    return isinstance(template, str) and "tool" in template


def _arguments(args: str | dict[str, Any]) -> Any:
    """A call's arguments as the object templates read; none given is ``{}`` (as in vLLM)."""
    if isinstance(args, dict):
        return args
    if not args.strip():
        return {}
    try:
        return json.loads(args)
    except ValueError:
        return args


def _native(messages: list[ChatMessage]) -> list[dict]:
    out = []
    for m in messages:
        msg: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": m.text() or "",
        }
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": _arguments(c.function.arguments),
                    },
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _fallback(messages: list[ChatMessage], tools: list[Tool] | None) -> list[dict]:
    out: list[dict] = []
    for m in messages:
        text = m.text() or ""
        if m.role == "tool":
            block = f"<tool_response>\n{text}\n</tool_response>"
            if out and out[-1].pop("_tool", False):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            out[-1]["_tool"] = True
            continue
        for c in m.tool_calls or ():
            call = json.dumps(
                {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                ensure_ascii=False,
            )
            text += ("\n" if text else "") + f"{OPEN}\n{call}\n{CLOSE}"
        msg = {"role": "system" if m.role == "developer" else m.role, "content": text}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    for msg in out:
        msg.pop("_tool", None)
    if tools:
        listing = "\n".join(
            json.dumps(t.model_dump(exclude_none=True, by_alias=True), ensure_ascii=False)
            for t in tools
        )
        prompt = _TOOLS_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0]["content"] += "\n\n" + prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def render_chat(
    tok,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    add_special_tokens: bool,
    tools: list[Tool] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    continue_final: bool = False,
    tools_prompt: bool = True,
) -> list[int]:
    """Runs on the tokenizer thread: a long conversation never blocks the event loop.
    ``tools``: those the model is offered (none with ``tool_choice: "none"``);
    ``template_kwargs``: the request's extra template variables; ``continue_final``: the
    prompt ends inside the last message, so that the output continues it; ``tools_prompt``
    (``--tools-system-prompt``, on by default): tools that the template does not render go
    into a system message; off, such a template gets none, as in vLLM."""
    kwargs: dict[str, Any] = {
        **(template_kwargs or {}),
        "tokenize": False,
        "add_generation_prompt": add_generation_prompt,
    }
    if continue_final:
        kwargs["continue_final_message"] = True
    if knows_tools(tok):
        dicts = _native(messages)
        if tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True, by_alias=True) for t in tools]
    else:
        dicts = _fallback(messages, tools if tools_prompt else None)
    try:
        text = tok.apply_chat_template(dicts, **kwargs)
    except Exception as e:  # jinja2 errors, templates that raise on bad role order, ...
        raise APIError(f"the chat template rejected the messages: {e}", param="messages") from None
    return tok.encode(text, add_special_tokens=add_special_tokens)


def chat_size(messages: list[ChatMessage], tools: list[Tool] | None = None) -> int:
    """Characters a chat template will see, for picking the tokenizer lane."""
    size = sum(
        len(m.text() or "") + 16 + sum(len(str(c.function.arguments)) for c in m.tool_calls or ())
        for m in messages
    )
    return size + sum(len(json.dumps(t.function.parameters or {})) for t in tools or ())
