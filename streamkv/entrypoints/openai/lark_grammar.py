"""Lark-syntax grammars → the EBNF (GBNF) the grammar engine compiles, as vLLM converts them.

vLLM reads a ``grammar`` with no ``::=`` on any line as Lark and converts it before xgrammar
sees it; this is our own converter for the same subset, a little wider:
- rules ``name: a b | c`` (continued on lines that do not start a rule), ``?`` / ``!``
  prefixes, ``.N`` priorities and ``-> alias`` names dropped (they shape Lark's tree, not the
  language); the ``start`` rule is the root, else the first rule (vLLM's choice);
- ``"strings"`` and ``'strings'`` (``i``: any case), ``"a".."z"`` ranges, ``[optional]``,
  ``( )``, ``* + ?``, ``~ n`` and ``~ n..m``;
- ``/regex/`` terminals without flags (lark_regex.py);
- ``%import common.NAME`` for Lark's common numbers, words, whitespace and ESCAPED_STRING.
``%ignore`` is refused: it lets whitespace in anywhere, which the rules would have to say
(vLLM drops the line, and with it what the grammar meant). Both ``//`` and ``#`` start a
comment outside strings and regexes, as in vLLM.
"""

from __future__ import annotations

import ast
import json
import re

_TOKEN = re.compile(
    r"""
    (?P<skip>[ \t\r\f]+|(?://|\#)[^\n]*)
  | (?P<nl>\n)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?|'(?:[^'\\\n]|\\.)*'i?)
  | (?P<regex>/(?![/*])(?:[^/\\\n]|\\.)+/[a-z]*)
  | (?P<directive>%[a-z]+[^\n]*)
  | (?P<name>[?!]?[_A-Za-z][_A-Za-z0-9]*)
  | (?P<num>\d+)
  | (?P<op>->|\.\.|[:|()\[\]*+?~.])
""",
    re.X,
)

_SIGN, _EXP = r"[+\-]?", r"([eE] [+\-]? [0-9]+)?"
# Lark's common.lark terminals, written out.
COMMON = {
    "DIGIT": "[0-9]",
    "HEXDIGIT": "[a-fA-F0-9]",
    "INT": "[0-9]+",
    "SIGNED_INT": f"{_SIGN} [0-9]+",
    "DECIMAL": '[0-9]+ "." [0-9]* | "." [0-9]+',
    "FLOAT": f'([0-9]+ "." [0-9]* | "." [0-9]+) {_EXP} | [0-9]+ [eE] [+\\-]? [0-9]+',
    "NUMBER": f'[0-9]+ ("." [0-9]*)? {_EXP} | "." [0-9]+ {_EXP}',
    "LCASE_LETTER": "[a-z]",
    "UCASE_LETTER": "[A-Z]",
    "LETTER": "[a-zA-Z]",
    "WORD": "[a-zA-Z]+",
    "CNAME": "[a-zA-Z_] [a-zA-Z0-9_]*",
    "WS_INLINE": "[ \\t]+",
    "WS": "[ \\t\\f\\r\\n]+",
    "CR": '"\\r"',
    "LF": '"\\n"',
    "NEWLINE": '("\\r"? "\\n")+',
    "ESCAPED_STRING": '"\\"" ([^"\\\\\\n] | "\\\\" [^\\n])* "\\""',
}
COMMON["SIGNED_FLOAT"] = f"{_SIGN} ({COMMON['FLOAT']})"
COMMON["SIGNED_NUMBER"] = f"{_SIGN} ({COMMON['NUMBER']})"


class LarkError(ValueError):
    pass


def is_lark(grammar: str) -> bool:
    """vLLM's test: EBNF defines its rules with ``::=``; a grammar with none is Lark."""
    return not any("::=" in re.sub(r"(#|//).*$", "", line) for line in grammar.splitlines())


def lark_to_ebnf(grammar: str) -> str:
    """The EBNF of a Lark grammar, or a LarkError saying what (and which line) it cannot take."""
    rules: dict[str, list[tuple[str, str, int]]] = {}
    imports: dict[str, str] = {}
    current: list[tuple[str, str, int]] | None = None
    for line_no, line in _lines(grammar):
        if line[0][0] == "directive":
            _directive(line[0][1], line_no, imports)
            continue
        head = [v for _, v, _ in line[1:4]]
        colon = 1 if head[:1] == [":"] else 3 if head[:1] == ["."] and head[2:3] == [":"] else 0
        if line[0][0] == "name" and colon:  # "name:" or "NAME.priority:"
            name = line[0][1].lstrip("?!")
            if name in rules:
                raise LarkError(f"line {line_no}: the rule {name!r} is defined twice")
            current = rules[name] = line[colon + 1 :]
        elif current is None:
            raise LarkError(f"line {line_no}: expected a rule ('name: ...'), got {line[0][1]!r}")
        else:
            current.extend(line)
    if not rules:
        raise LarkError("no rules: a Lark grammar defines rules as 'name: ...'")
    start = "start" if "start" in rules else next(iter(rules))
    names = {n: n for n in (*rules, *imports)}
    if "root" in names and start != "root":
        names["root"] = "lark_root"  # the EBNF's own entry point
    out = [] if start == "root" else [f"root ::= {names[start]}"]
    for name, body in rules.items():
        out.append(f"{names[name]} ::= {_expression(body, names)}")
    out.extend(f"{names[alias]} ::= {COMMON[term]}" for alias, term in imports.items())
    return "\n".join(out)


def _lines(grammar: str):
    """(line number, its tokens) for each line holding any."""
    line: list[tuple[str, str, int]] = []
    line_no, pos = 1, 0
    while pos < len(grammar):
        m = _TOKEN.match(grammar, pos)
        if m is None:
            raise LarkError(f"line {line_no}: unexpected {grammar[pos : pos + 20]!r}")
        kind, pos = m.lastgroup, m.end()
        if kind == "nl":
            if line:
                yield line_no, line
            line, line_no = [], line_no + 1
        elif kind != "skip":
            line.append((kind, m.group(), line_no))
    if line:
        yield line_no, line


def _directive(text: str, line_no: int, imports: dict[str, str]) -> None:
    m = re.fullmatch(
        r"%import\s+common\s*\.\s*([A-Z_]+)(?:\s*->\s*(\w+))?\s*", text
    ) or re.fullmatch(r"%import\s+common\s*\(([\w\s,]+)\)\s*", text)
    if m is None:
        word = text.split()[0]
        why = (
            "it lets whitespace in between any tokens; write it into the rules"
            if word == "%ignore"
            else "only '%import common.NAME' is supported"
        )
        raise LarkError(f"line {line_no}: {word} is not supported: {why}")
    pairs = (
        [(m.group(1), m.group(2) or m.group(1))]
        if m.re.pattern.startswith(r"%import\s+common\s*\.")
        else [(n.strip(), n.strip()) for n in m.group(1).split(",") if n.strip()]
    )
    for term, alias in pairs:
        if term not in COMMON:
            raise LarkError(
                f"line {line_no}: common.{term} is not "
                f"supported; known: {', '.join(sorted(COMMON))}"
            )
        imports[alias] = term


def _expression(tokens: list[tuple[str, str, int]], names: dict[str, str]) -> str:
    # Imported here: lark_regex.py raises this module's LarkError.
    from streamkv.entrypoints.openai.lark_regex import regex_to_ebnf

    out: list[str] = []
    empty = True  # nothing in the current alternative yet
    i = 0
    while i < len(tokens):
        kind, text, line_no = tokens[i]
        i += 1
        if kind == "name":
            if text not in names:
                raise LarkError(f"line {line_no}: {text!r} is not defined")
            out.append(names[text])
        elif kind == "string":
            i, item = _string_or_range(tokens, i, text, line_no)
            out.append(item)
        elif kind == "regex":
            out.append(regex_to_ebnf(text, line_no))
        elif text == "->":  # an alias names the tree node: no part of the language
            i += 1
            continue
        elif text == "~":
            i, rep = _repeat(tokens, i, line_no)
            out.append(rep)
            continue
        elif text in ("|", "("):
            if text == "|" and empty:
                out.append('""')
            out.append(text)
            empty = True
            continue
        elif text == "[":
            out.append("(")
            empty = True
            continue
        elif text in ("]", ")"):
            if empty:
                out.append('""')
            out.append(")?" if text == "]" else ")")
        elif text in ("*", "+", "?"):
            out.append(text)
        else:
            raise LarkError(f"line {line_no}: unexpected {text!r}")
        empty = False
    if empty:
        out.append('""')
    return " ".join(out)


def _string_or_range(
    tokens: list[tuple[str, str, int]], i: int, text: str, line_no: int
) -> tuple[int, str]:
    """The string ``text`` (just before ``tokens[i]``), or the ``"a".."z"`` range it opens."""
    if i + 1 < len(tokens) and tokens[i][1] == ".." and tokens[i + 1][0] == "string":
        low, high = _string(text, line_no), _string(tokens[i + 1][1], line_no)
        if len(low) != 1 or len(high) != 1:
            raise LarkError(f"line {line_no}: a range joins two one-character strings")
        return i + 2, f"[{_class_char(low)}-{_class_char(high)}]"
    return i, _literal(text, line_no)


def _repeat(tokens: list[tuple[str, str, int]], i: int, line_no: int) -> tuple[int, str]:
    """``~ n`` or ``~ n..m`` after an item: EBNF's ``{n}`` / ``{n,m}``."""
    texts = [t[1] for t in tokens[i : i + 3]]
    if texts[:1] and texts[0].isdigit():
        if texts[1:2] == [".."] and len(texts) == 3 and texts[2].isdigit():
            return i + 3, f"{{{texts[0]},{texts[2]}}}"
        return i + 1, f"{{{texts[0]}}}"
    raise LarkError(f"line {line_no}: '~' takes a count: item ~ 3 or item ~ 2..5")


def _string(token: str, line_no: int) -> str:
    try:
        value = ast.literal_eval(token.removesuffix("i") if token.endswith("i") else token)
    except (SyntaxError, ValueError):
        raise LarkError(f"line {line_no}: bad string {token[:40]}") from None
    if not isinstance(value, str):
        raise LarkError(f"line {line_no}: bad string {token[:40]}")
    return value


def _literal(token: str, line_no: int) -> str:
    value = _string(token, line_no)
    if not value:
        return '""'
    if token.endswith("i") and any(c.isalpha() for c in value):
        return (
            "("
            + " ".join(
                f"[{_class_char(c.lower())}{_class_char(c.upper())}]"
                if c.isalpha()
                else json.dumps(c, ensure_ascii=False)
                for c in value
            )
            + ")"
        )
    return json.dumps(value, ensure_ascii=False)


def _class_char(c: str) -> str:
    return "\\" + c if c in "\\]-^[" else json.dumps(c, ensure_ascii=False)[1:-1]
