"""``streamkv chat``: talk to a running server from the terminal (as ``vllm chat``). Each
reply streams from ``/v1/chat/completions``; the conversation is kept until ``/reset``.
Only the standard library and httpx: no engine, no model loaded here."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HELP = "/reset forgets the conversation, /exit (or Ctrl-D) quits"


def add_chat_parser(sub) -> argparse.ArgumentParser:
    from streamkv.entrypoints.cli.common import HelpFormatter

    p = sub.add_parser(
        "chat",
        help="chat with a running server from the terminal",
        formatter_class=HelpFormatter,
        allow_abbrev=False,
        description=(
            f"Chat with a running `streamkv serve` (or any OpenAI-compatible server). {HELP}."
        ),
    )
    p.add_argument(
        "--url", default="http://127.0.0.1:8000", help="the server (its /v1 API is used)"
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("STREAMKV_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (default: $STREAMKV_API_KEY)",
    )
    p.add_argument(
        "--model-name", default=None, help="the model to ask for (default: the server's first)"
    )
    p.add_argument("--system-prompt", default=None, help="a system message before the conversation")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument(
        "-q",
        "--quick",
        metavar="MESSAGE",
        default=None,
        help="send one message, print the reply, exit",
    )
    p.set_defaults(func=cmd_chat)
    return p


class ChatError(Exception):
    pass


def _error_text(r) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {r.status_code}"


def stream_reply(client, url: str, body: dict, out) -> tuple[str, dict | None]:
    """Stream one reply to ``out``; its text and the usage the server reported."""
    import httpx

    text, usage = [], None
    try:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise ChatError(_error_text(r))
            for line in r.iter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("error"):
                    raise ChatError(chunk["error"].get("message", "the server reported an error"))
                usage = chunk.get("usage") or usage
                for c in chunk.get("choices", []):
                    piece = (c.get("delta") or {}).get("content") or ""
                    text.append(piece)
                    out.write(piece)
                    out.flush()
    except httpx.ConnectError:
        raise ChatError(
            f"no server at {url} (start one with `streamkv serve`, or give --url)"
        ) from None
    except httpx.HTTPError as e:
        raise ChatError(f"the connection to {url} failed: {e}") from None
    return "".join(text), usage


def cmd_chat(args: argparse.Namespace) -> int:
    import logging

    import httpx

    # A line per request would cut into the replies.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(headers=headers, timeout=httpx.Timeout(10.0, read=None)) as client:
        try:
            model = args.model_name or _first_model(client, url)
        except ChatError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        if args.quick is None:
            print(f"chatting with {model} at {url} · {HELP}", file=sys.stderr)
        return _converse(client, url, model, args)


def _converse(client, url: str, model: str, args: argparse.Namespace) -> int:
    """The conversation loop: one turn per line read, or the single turn of --quick."""
    interactive = args.quick is None
    system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    messages: list[dict] = []
    while True:
        line = _read_line(args.quick)
        command = line.strip() if line is not None else "/exit"
        if command in ("/exit", "/quit"):
            return 0
        if command in ("/reset", ""):
            if command:
                messages.clear()
                print("(the conversation is forgotten)", file=sys.stderr)
            if not interactive:  # --quick is one turn, whatever it says
                return 0
            continue
        messages.append({"role": "user", "content": line})
        body = {
            "model": model,
            "messages": system + messages,
            "stream": True,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "stream_options": {"include_usage": True},
        }
        try:
            reply = _reply(client, url, body)
        except ChatError as e:
            print(f"error: {e}", file=sys.stderr)
            if not interactive:
                return 1
            reply = None
        if reply is None:  # failed or stopped: forget the unanswered message
            if not interactive:
                return 1
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})
        if not interactive:
            return 0


def _read_line(quick: str | None) -> str | None:
    """The next message: --quick's, or typed at the prompt; None at Ctrl-D or Ctrl-C."""
    if quick is not None:
        return quick
    try:
        return input("> ")
    except (EOFError, KeyboardInterrupt):
        print(file=sys.stderr)
        return None


def _reply(client, url: str, body: dict) -> str | None:
    """Stream one reply, then its tokens/s; None when Ctrl-C stopped it (the chat goes on)."""
    t0 = time.perf_counter()
    try:
        reply, usage = stream_reply(client, url, body, sys.stdout)
    except KeyboardInterrupt:  # stops this reply, not the chat
        print("\n(stopped)", file=sys.stderr)
        return None
    took = time.perf_counter() - t0
    tokens = usage["completion_tokens"] if usage else None
    print()
    if tokens:
        print(f"[{tokens} tokens in {took:.1f} s · {tokens / took:.1f} tok/s]", file=sys.stderr)
    return reply


def _first_model(client, url: str) -> str:
    import httpx

    try:
        r = client.get(f"{url}/v1/models")
    except httpx.ConnectError:
        raise ChatError(
            f"no server at {url} (start one with `streamkv serve`, or give --url)"
        ) from None
    except httpx.HTTPError as e:
        raise ChatError(f"cannot reach {url}: {e}") from None
    if r.status_code == 401:
        raise ChatError("the server needs an API key: give --api-key (or set $STREAMKV_API_KEY)")
    if r.status_code != 200:
        raise ChatError(f"{url}/v1/models: {_error_text(r)}")
    return r.json()["data"][0]["id"]
