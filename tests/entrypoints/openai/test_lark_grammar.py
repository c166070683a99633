"""Lark-syntax grammars (vLLM converts them to EBNF for xgrammar): the converted grammar
compiles and accepts exactly its language; through the API a Lark grammar is served and a
bad one is a 400 naming the field the request used. Fast: the fake engine, no model."""

from __future__ import annotations

import pytest

from streamkv.engine.grammar_limits import check_spec
from streamkv.entrypoints.openai.chat_request import ChatCompletionRequest
from streamkv.entrypoints.openai.errors import APIError
from streamkv.entrypoints.openai.lark_grammar import LarkError, is_lark, lark_to_ebnf
from streamkv.entrypoints.openai.lark_regex import regex_to_ebnf
from streamkv.entrypoints.openai.protocol import validate
from tests.entrypoints.fake_engine import make_client, wait_healthy

xgr = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string as accepts  # noqa: E402

JSON_LARK = r"""
?start: value
?value: dict | list | string | SIGNED_NUMBER -> number
      | "true" | "false" | "null"
list : "[" [value ("," value)*] "]"
dict : "{" [pair ("," pair)*] "}"
pair : string ":" value
string : ESCAPED_STRING
%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
"""
ASSIGN_LARK = r"""
// a comment, and a '#' one as vLLM strips too
start: NAME "=" NUM ("," NUM)* ";"?   # trailing comment
NAME: /[a-z_]\w*/
NUM.2: /-?\d+(\.\d+)?/
"""
CASES = [
    (
        JSON_LARK,
        ['{"a":[1,-2.5e3,"x"]}', "true", "[]", '{"k":{"n":null}}'],
        ['{"a" 1}', "tru", "[1,]", "'x'"],
    ),
    (ASSIGN_LARK, ["x=1,2.5;", "x_1=-3"], ["X=1", "x=", "x=1.", "x = 1"]),
    (
        'start: \'ab\'i ~ 2..3 | "a".."c" ~ 2 | ["q"] | foo\n!foo: "z"',
        ["abAB", "aBAbab", "ca", "z", "", "q"],
        ["abababab", "d", "qq"],
    ),
]


def compiled(lark: str):
    ebnf = lark_to_ebnf(lark)
    check_spec("grammar", ebnf)  # the grammar limits take it as any EBNF
    return xgr.Grammar.from_ebnf(ebnf)


@pytest.mark.parametrize(
    "lark, good, bad", CASES, ids=["json", "regex-terminals", "ranges-repeats"]
)
def test_converted_grammar_accepts_exactly_its_language(lark, good, bad):
    grammar = compiled(lark)
    assert all(accepts(grammar, s) for s in good), [s for s in good if not accepts(grammar, s)]
    assert not any(accepts(grammar, s) for s in bad), [s for s in bad if accepts(grammar, s)]


def test_lark_is_told_from_ebnf_by_its_rule_sign():
    assert is_lark(JSON_LARK) and is_lark("start: 'a'")
    assert not is_lark('root ::= "a" // a: b')
    assert is_lark('start: "a"  // root ::= x')  # in a comment, ::= says nothing


def test_a_rule_named_root_keeps_the_entry_point():
    ebnf = lark_to_ebnf('start: root root\nroot: "r"')
    assert ebnf.splitlines()[0] == "root ::= start" and "lark_root ::=" in ebnf
    assert accepts(xgr.Grammar.from_ebnf(ebnf), "rr")


@pytest.mark.parametrize(
    "lark, says",
    [
        ('start: WORD\n%import common.WORD\n%ignore " "', "%ignore"),
        ("start: FOO\n%import mylib.FOO", "common.NAME"),
        ("start: X\n%import common.NOPE -> X", "common.NOPE"),
        ("start: missing", "'missing' is not defined"),
        ('start: "a"\nstart: "b"', "defined twice"),
        ('"a" | "b"', "expected a rule"),
        ("start: /^a/", "anchor"),
        ("start: /(?=a)a/", "lookaround"),
        ("start: /a/i", "flags"),
        ("start: /(a)\\1/", "back-references"),
        ('start: "a" ~ x', "'~' takes a count"),
        ('start: "ab".."c"', "one-character"),
        ("", "no rules"),
    ],
)
def test_bad_grammars_say_why(lark, says):
    with pytest.raises(LarkError, match=None) as e:
        lark_to_ebnf(lark)
    assert says in str(e.value), str(e.value)


def test_regex_terminal_translation():
    g = xgr.Grammar.from_ebnf("root ::= " + regex_to_ebnf(r"/(?:ab|c)+?[^\s\d]{2}x?.\//"))
    assert accepts(g, "abcZZ_/") and accepts(g, "cxyx:/")
    assert not accepts(g, "ab1Z_/") and not accepts(g, "cZZ\n/")


@pytest.mark.parametrize("field", ["structured_outputs", "guided_grammar"])
def test_requests_carry_the_converted_grammar(field):
    body = (
        {"structured_outputs": {"grammar": ASSIGN_LARK}}
        if field == "structured_outputs"
        else {"guided_grammar": ASSIGN_LARK}
    )
    req = validate(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **body})
    so = req.params().structured_outputs
    assert so.kind == "grammar" and so.grammar == lark_to_ebnf(ASSIGN_LARK)
    ebnf = 'root ::= "a" | "b"'
    req = validate(
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": "hi"}], "guided_grammar": ebnf},
    )
    assert req.params().structured_outputs.grammar == ebnf  # EBNF passes through untouched


@pytest.fixture(scope="module")
def client():
    with make_client() as c:
        wait_healthy(c)
        yield c


def test_a_lark_grammar_is_served(client):
    r = client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "guided_grammar": JSON_LARK}
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "body, param",
    [
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs"),
        ({"guided_grammar": 'start: "a"\n%ignore " "'}, "guided_grammar"),
    ],
)
def test_a_bad_lark_grammar_is_a_400_naming_the_field(client, body, param):
    r = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **body}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "Lark grammar" in error["message"], error
    with pytest.raises(APIError):
        validate(
            ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **body}
        ).params()
