"""Lark ``/regex/`` terminals → EBNF, for lark_grammar.py: literals, classes, ``.``,
``\\d \\w \\s``, groups, alternation and quantifiers (lazy ones read as greedy: the same
language). Anchors, lookarounds, back-references and flags are refused by name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from streamkv.entrypoints.openai.lark_grammar import LarkError

_CLASSES = {"d": "0-9", "w": "a-zA-Z0-9_", "s": " \\t\\n\\r\\f\\v"}
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}


def regex_to_ebnf(token: str, line_no: int = 1) -> str:
    """A Lark ``/regex/`` terminal as an EBNF expression (one group)."""
    body, flags = token[1 : token.rindex("/")], token[token.rindex("/") + 1 :]
    if flags:
        raise LarkError(f"line {line_no}: regex flags ('{flags}') are not supported")
    out, empty, i = ["("], True, 0

    def fail(why: str) -> LarkError:
        return LarkError(f"line {line_no}: the regex {token[:40]} {why}")

    while i < len(body):
        c = body[i]
        if c == "(":
            i = _skip_group_prefix(body, i + 1, fail)
            out.append("(")
            empty = True
        elif c in "|)":
            if empty:
                out.append('""')
            out.append(c)
            empty = c == "|"
            i += 1
        elif c in "*+?":
            if empty:
                raise fail(f"has '{c}' with nothing before it")
            out[-1] += c
            i += 2 if body[i + 1 : i + 2] == "?" else 1  # lazy: the same language
        elif c == "{" and (m := re.match(r"\{\d+(,\d*)?\}", body[i:])):
            out[-1] += m.group(0)
            i += m.end()
        else:
            i, atom = _regex_atom(body, i, fail)
            out.append(atom)
            empty = False
    if empty:
        out.append('""')
    return " ".join(out) + " )"


def _skip_group_prefix(body: str, i: int, fail: Callable[[str], LarkError]) -> int:
    """Past the ``?:`` or ``?P<name>`` after the ``(`` at ``body[i - 1]``; refuses other ``(?``."""
    if body.startswith("?:", i):
        return i + 2
    if body.startswith("?P<", i):
        return body.index(">", i) + 1
    if body.startswith("?", i):
        raise fail("uses a lookaround or inline flag (not supported)")
    return i


def _regex_atom(body: str, i: int, fail: Callable[[str], LarkError]) -> tuple[int, str]:
    """The one-character-wide item at ``body[i]``: (index after it, its EBNF)."""
    c = body[i]
    i += 1
    if c == "\\":
        return _regex_escape(body, i, fail)
    if c == "[":
        return _regex_class(body, i, fail)
    if c == ".":
        return i, "[^\\n]"
    if c in "^$":
        raise fail("uses an anchor (not supported)")
    return i, json.dumps(c, ensure_ascii=False)


def _regex_escape(body: str, i: int, fail: Callable[[str], LarkError]) -> tuple[int, str]:
    """The escape after the backslash at ``body[i - 1]``: (index after it, its EBNF)."""
    if i >= len(body):
        raise fail("ends with a lone backslash")
    e = body[i]
    i += 1
    if e.lower() in _CLASSES:
        return i, f"[{'^' if e.isupper() else ''}{_CLASSES[e.lower()]}]"
    if e in "xu":
        width = 2 if e == "x" else 4
        try:
            return i + width, json.dumps(chr(int(body[i : i + width], 16)), ensure_ascii=False)
        except ValueError:
            raise fail(f"has a bad \\{e} escape") from None
    if e in _ESCAPES:
        return i, json.dumps(_ESCAPES[e])
    if e.isalnum():
        raise fail(f"uses \\{e} (anchors and back-references are not supported)")
    return i, json.dumps(e)


def _regex_class(body: str, i: int, fail: Callable[[str], LarkError]) -> tuple[int, str]:
    """The class opened by the ``[`` at ``body[i - 1]``: (index after its ``]``, its EBNF)."""
    end = i + (1 if body[i : i + 1] == "^" else 0)
    end += 1 if body[end : end + 1] == "]" else 0
    while end < len(body) and body[end] != "]":
        end += 2 if body[end] == "\\" else 1
    if end >= len(body):
        raise fail("has an unclosed '['")
    inner = re.sub(r"\\([dws])", lambda m: _CLASSES[m.group(1)], body[i:end])
    if re.search(r"\\[DWS]", inner):
        raise fail("uses \\D, \\W or \\S inside a class (not supported)")
    return end + 1, f"[{inner}]"
