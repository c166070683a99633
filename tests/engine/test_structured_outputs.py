"""Structured outputs (engine/structured.py, layers/token_mask.py): every output follows its
grammar and validates against its schema; other rows of the batch are untouched; bad specs
are refused with InvalidParameter before they queue."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import numpy as np
import pytest
import torch

from streamkv.layers.token_mask import apply_token_masks
from streamkv.sampling_params import InvalidParameter, SamplingParams, StructuredOutputs

SCHEMAS = {
    "required fields": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0},
        },
        "required": ["name", "age"],
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 8},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "email": {"type": "string", "maxLength": 24},
                },
                "required": ["id", "email"],
            },
            "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
        },
        "required": ["user", "scores"],
    },
}
PROMPT = "Reply with JSON only. A user record:"


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(block_size=16, num_kv_blocks=1024, num_swap_blocks=0)


def _greedy(structured=None, max_tokens=96, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, structured_outputs=structured, **kw
    )


@pytest.mark.slow
def test_json_schema_outputs_parse_and_validate(llm):
    names = list(SCHEMAS)
    outs = llm.generate([PROMPT] * len(names), [_greedy({"json": SCHEMAS[n]}) for n in names])
    for name, out in zip(names, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (name, c.text)
        jsonschema.validate(json.loads(c.text), SCHEMAS[name])
    # The schema's key order is the output's.
    assert list(json.loads(outs[0].outputs[0].text)) == ["name", "age"]


@pytest.mark.slow
def test_json_object_regex_and_choice(llm):
    choices = ["yes", "no", "maybe (later)"]
    specs = [
        {"json_object": True},
        {"regex": r"[0-9]{3}-[0-9]{4}"},
        {"choice": choices},
        {"grammar": 'root ::= "ab" digit digit? "z"\ndigit ::= [0-9]'},
    ]
    prompts = [
        'Return a JSON object with the key "answer" set to yes.\n',
        "A phone number:",
        "Will it rain?",
        "Code:",
    ]
    outs = llm.generate(prompts, [_greedy(s, 32) for s in specs])
    texts = [o.outputs[0].text for o in outs]
    assert isinstance(json.loads(texts[0]), dict)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", texts[1]), texts[1]
    assert texts[2] in choices
    assert re.fullmatch(r"ab[0-9]{1,2}z", texts[3]), texts[3]
    # A finished grammar ends the output at once ("stop"), without sampling EOS.
    eos = llm.engine.eos_token_ids
    for o in outs[1:]:
        assert o.outputs[0].finish_reason == "stop" and not eos & set(o.outputs[0].token_ids)


@pytest.mark.slow
def test_unconstrained_rows_keep_their_greedy_tokens(llm):
    plain = ["The capital of France is", "def add(a, b):", "Once upon a time"]
    alone = llm.generate(plain, _greedy(max_tokens=20))
    mixed_params = [_greedy(max_tokens=20)] * 3 + [
        _greedy({"json": SCHEMAS["enum"]}, 32),
        _greedy({"regex": "[a-z]{5}"}),
    ]
    mixed = llm.generate(plain + [PROMPT, "A word:"], mixed_params)
    for a, m in zip(alone, mixed[:3]):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids
    jsonschema.validate(json.loads(mixed[3].outputs[0].text), SCHEMAS["enum"])
    assert re.fullmatch("[a-z]{5}", mixed[4].outputs[0].text)


@pytest.mark.slow
def test_parallel_samples_each_follow_the_schema(llm):
    schema = SCHEMAS["required fields"]
    params = SamplingParams(
        n=3, temperature=1.0, seed=7, max_tokens=64, structured_outputs={"json": schema}
    )
    out = llm.generate([PROMPT], params)[0]
    texts = [c.text for c in out.outputs]
    assert len(texts) == 3
    for t in texts:
        jsonschema.validate(json.loads(t), schema)
    assert len(set(texts)) > 1  # forks sample on their own: each matcher is its own copy


@pytest.mark.slow
def test_bad_specs_are_refused_by_name(llm):
    engine = llm.engine
    for spec in ({"json": {"type": "objectx"}}, {"regex": "(("}, {"grammar": "root ::= missing"}):
        with pytest.raises(InvalidParameter) as e:
            engine.add_request("bad", PROMPT, _greedy(spec))
        assert e.value.param == "structured_outputs" and "cannot be compiled" in str(e.value)
    assert "bad" not in engine.groups and not engine.has_unfinished_requests()
    for spec in (
        {},
        {"json": "{not json"},
        {"regex": "a", "choice": ["a"]},
        {"choice": []},
        {"jsonx": {}},
    ):
        with pytest.raises(InvalidParameter) as e:
            SamplingParams(structured_outputs=spec)
        assert e.value.param == "structured_outputs"
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(
            use_beam_search=True, best_of=2, temperature=0.0, structured_outputs={"regex": "a+"}
        )
    assert e.value.param == "structured_outputs"


@pytest.mark.slow
def test_schemas_compile_once(llm):
    manager = llm.engine.structured
    a = StructuredOutputs(json=SCHEMAS["enum"])
    b = StructuredOutputs(json=json.dumps(SCHEMAS["enum"]))  # the same schema as JSON text
    assert a.key() == b.key()
    assert manager._compiled(a) is manager._compiled(b)


@pytest.mark.slow
def test_forked_matchers_are_independent(llm):
    manager = llm.engine.structured
    tok = llm.get_tokenizer()
    g = manager.new_grammar(_greedy({"choice": ["red", "blue"]}))
    child = g.fork()
    assert child.mask_bytes() == g.mask_bytes()
    red, blue = (
        tok.encode("red", add_special_tokens=False),
        tok.encode("blue", add_special_tokens=False),
    )
    assert [g.accept(t) for t in red][-1] is True
    assert not child.matcher.is_terminated()
    assert [child.accept(t) for t in blue][-1] is True


def test_token_masks_ban_outside_tokens_and_leave_other_rows():
    vocab = 100
    rng = np.random.default_rng(0)
    allowed = rng.random((2, vocab)) < 0.2
    words = np.packbits(allowed, axis=1, bitorder="little")
    words = np.pad(words, ((0, 0), (0, (-words.shape[1]) % 4))).view("<i4")
    for dtype in (torch.float32, torch.float64):  # the numpy path and the torch path
        logits = torch.randn(4, vocab, dtype=dtype)
        before = logits.clone()
        apply_token_masks(logits, [None, words[0].tobytes(), None, words[1].tobytes()])
        assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
        for row, a in ((1, allowed[0]), (3, allowed[1])):
            assert (torch.isfinite(logits[row]).numpy() == a).all()
            assert torch.equal(logits[row][torch.from_numpy(a)], before[row][torch.from_numpy(a)])


def _random_masks(rows: int, vocab: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Allowed-token matrices and their packed words (ceil(vocab / 32) int32 words a row)."""
    allowed = np.random.default_rng(seed).random((rows, vocab)) < 0.3
    words = np.packbits(allowed, axis=1, bitorder="little")
    return allowed, np.pad(words, ((0, 0), (0, (-words.shape[1]) % 4))).view("<i4")


def test_token_mask_kernel_compiles_for_sm80_and_sm90(tmp_path, monkeypatch):
    pytest.importorskip("cuda.bindings.nvrtc")
    from streamkv.kernels import nvrtc, token_mask_cuda

    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(tmp_path))
    for arch in (80, 90):
        compiled = nvrtc.compile_program(token_mask_cuda.SOURCE, (token_mask_cuda.NAME,), arch)
        assert compiled.lowered[token_mask_cuda.NAME].encode() in compiled.image


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("vocab", [49152, 1000])  # a multiple of 32, and a last word half used
def test_token_mask_kernel_matches_the_cpu_path(vocab):
    allowed, words = _random_masks(5, vocab)
    for masks in (
        [w.tobytes() for w in words],
        [None, words[1], None, words[3].tobytes(), words[4]],
    ):
        logits = torch.randn(len(masks), vocab)
        want = logits.clone()
        apply_token_masks(want, masks)  # the numpy path
        got = logits.cuda()
        apply_token_masks(got, masks)  # the kernel
        assert torch.equal(got.cpu(), want)
        for i, m in enumerate(masks):
            if m is not None:
                assert (torch.isfinite(got[i]).cpu().numpy() == allowed[i]).all()


def _ban_like_the_kernel(logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor) -> None:
    """kernels_cu/token_mask.cu in torch: logits row rows[r] banned outside words[r]."""
    vocab = logits.shape[1]
    bits = torch.arange(vocab)
    for r in range(words.shape[0]):
        allowed = (words[r][bits // 32] >> (bits % 32)) & 1
        logits[int(rows[r])][allowed == 0] = -math.inf


def test_staged_masks_upload_once_in_any_row_order():
    from streamkv.layers.token_mask import MaskStaging, staged_fill, upload_staged

    vocab = 1000  # the last word half used
    allowed, words = _random_masks(5, vocab)
    staging = MaskStaging(words.shape[1], pin=False)
    staged = staging.fill(5, lambda view: np.copyto(view, words))
    buffer = staging.host.data_ptr()
    assert staging.fill(3, lambda view: np.copyto(view, words[:3])) == staged[:3]
    assert staging.host.data_ptr() == buffer  # no buffer a step
    staged = staging.fill(5, lambda view: np.copyto(view, words))
    # The sampler's rows: 7 logits rows, two unmasked, the staged rows in another order.
    masks = [staged[3], None, staged[0], staged[4], None, staged[2], staged[1]]
    picked = [m for m in masks if m is not None]
    assert staged_fill(picked) is staging
    assert staged_fill(picked[:4]) is None  # not the whole fill: the general path
    assert staged_fill([words[0].tobytes()] + picked[1:]) is None
    logits = torch.randn(len(masks), vocab)
    want = logits.clone()
    apply_token_masks(want, masks)  # the numpy path, through StagedMask.words
    got = logits.clone()
    dev_words, dev_rows = upload_staged(
        staging, picked, [i for i, m in enumerate(masks) if m is not None], torch.device("cpu")
    )
    _ban_like_the_kernel(got, dev_words, dev_rows)
    assert torch.equal(got, want)
    for i, m in enumerate(masks):
        assert (
            torch.isfinite(want[i]).numpy() == (allowed[m.row] if m is not None else True)
        ).all()
    staging.fill(300, lambda view: view.fill(-1))  # past the capacity: grown
    assert staging.capacity >= 300 and staging.host.data_ptr() != buffer


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("vocab", [49152, 1000])
def test_staged_kernel_path_matches_the_cpu_path(vocab):
    from streamkv.layers.token_mask import MaskStaging

    allowed, words = _random_masks(5, vocab)
    staging = MaskStaging(words.shape[1])
    assert staging.pin
    for step in range(3):  # the buffers and the cached launch are reused
        rolled = np.roll(words, step, axis=0)
        staged = staging.fill(5, lambda view, src=rolled: np.copyto(view, src))
        masks = [staged[3], None, staged[0], staged[4], None, staged[2], staged[1]]
        logits = torch.randn(len(masks), vocab)
        want = logits.clone()
        apply_token_masks(want, masks)  # the numpy path
        got = logits.cuda()
        apply_token_masks(got, masks)  # one upload of the staging buffer, the cached launch
        assert staging.launch is not None
        assert torch.equal(got.cpu(), want)
        for i, m in enumerate(masks):
            if m is not None:
                assert (torch.isfinite(got[i]).cpu().numpy() == allowed[(m.row - step) % 5]).all()


def test_bench_shape_dir_has_the_presets_dims_and_the_tokenizers_vocab(tmp_path):
    from benchmarks.bench_structured import shaped_model_dir
    from streamkv.config import ModelConfig
    from streamkv.models.loader import load_tokenizer, resolve_model_dir, resolve_model_info

    source = resolve_model_dir(None)  # SmolLM2-135M: 49,152 tokens, EOS 2
    tokens = json.loads((source / "config.json").read_text())
    out = shaped_model_dir("llama3-8b", source, tmp_path / "shaped")
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (
        4096,
        32,
        8,
    )
    assert (
        config["vocab_size"] == tokens["vocab_size"] == 49152
        and config["eos_token_id"] == tokens["eos_token_id"]
    )
    assert "_source" not in config and config["tie_word_embeddings"] is False
    tokenizer = load_tokenizer(out)
    info = resolve_model_info(ModelConfig(model=str(out)), out, tokenizer)
    assert (
        info.vocab_size == 49152
        and info.num_layers == 32
        and tokens["eos_token_id"] in info.eos_token_ids
    )
    assert tokenizer.encode("{", add_special_tokens=False) == load_tokenizer(source).encode(
        "{", add_special_tokens=False
    )


@pytest.mark.slow
def test_batched_accept_matches_accepting_row_by_row(llm):
    from streamkv.engine.structured import accept_tokens

    manager, tok = llm.engine.structured, llm.get_tokenizer()
    red = tok.encode("red strawberry milkshake", add_special_tokens=False)
    assert len(red) >= 2
    rows = [
        manager.new_grammar(_greedy({"choice": ["red strawberry milkshake", "blue"]}))
        for _ in range(3)
    ]
    twins = [g.fork() for g in rows]
    for step in range(len(red)):
        # Row 2 takes a token its grammar refuses at the first step: it ends, with a warning.
        tokens = [
            red[step],
            red[step],
            red[step] if step else tok.encode("blue", add_special_tokens=False)[-1],
        ]
        live = [i for i in range(3) if step == 0 or i != 2]
        got = accept_tokens([rows[i] for i in live], [tokens[i] for i in live])
        assert got == [twins[i].accept(tokens[i]) for i in live]
        if step == 0:
            assert got == [False, False, True]  # the refused token ends row 2 (with a warning)
    assert got == [True, True]  # the choice complete: only a stop token may follow
