"""The incremental detokenizer decodes through the fast tokenizer's backend when there is one,
and gives the same text as through transformers' decode, byte pieces and all."""

from __future__ import annotations

import pytest

from streamkv.engine.detokenizer import Detokenizer
from streamkv.models.loader import load_tokenizer, resolve_model_dir
from streamkv.sequence import Sequence

TEXT = "Héllo wörld 😊🏖️ — “quotes”,  double  spaces, 中文 and\ttabs\n"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model_dir(None))


def _stream(detok: Detokenizer, prompt: list[int], output: list[int]) -> tuple[str, list[str]]:
    seq = Sequence(0, list(prompt))
    pieces = []
    for t in output:
        seq.output_token_ids.append(t)
        pieces.append(detok.update(seq))
    return seq.output_text, pieces


def test_backend_and_wrapper_decode_the_same_stream(tok):
    fast = Detokenizer(tok)
    assert fast._backend_decode is not None  # SmolLM2 ships a fast tokenizer
    slow = Detokenizer(tok)
    slow._backend_decode = None  # transformers' decode
    prompt = tok("Say something:").input_ids
    output = tok(TEXT).input_ids + [tok.eos_token_id]
    text, pieces = _stream(fast, prompt, output)
    assert (text, pieces) == _stream(slow, prompt, output)
    assert text == tok.decode(output, skip_special_tokens=True)
    assert "\ufffd" not in "".join(pieces)  # half characters wait for their other bytes
