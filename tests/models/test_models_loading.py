"""Where weights come from: Hugging Face directories (tokenizer and chat template included or
not), .gguf files, and the errors for what streamkv refuses."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from hf_tiny import greedy_compare, prompts, save_tiny
from safetensors.torch import load_file, save_file
from tiny_gguf import write_tiny_gguf
from transformers import LlamaConfig, OPTConfig

from streamkv import SamplingParams
from streamkv.entrypoints.llm import LLM
from streamkv.models.loader import has_tokenizer_files, load_tokenizer, resolve_model_dir
from tests.tiny_models import TINY_LLAMA

TINY = {**TINY_LLAMA, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
SMALL = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 32, "num_swap_blocks": 0}


def save_word_tokenizer(path) -> None:
    """A word-level tokenizer ("w0".."w996" and three specials) with a chat template.

    Special tokens are matched before splitting, so they must not prefix a word ("w1" would
    cut "w10" in two)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(997)} | {"<unk>": 997, "<s>": 998, "</s>": 999}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=(
            "{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}"
            "{% if add_generation_prompt %}w5{% endif %}"
        ),
    ).save_pretrained(str(path))


def test_tokenizer_and_chat_template_come_from_the_directory(tmp_path):
    hf = save_tiny(LlamaConfig(**TINY), tmp_path)
    save_word_tokenizer(tmp_path)
    llm = LLM(str(tmp_path), **SMALL)
    tok = llm.get_tokenizer()
    assert tok is not None and tok.chat_template
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = llm.generate("w10 w11 w12", params)[0]
    assert list(out.prompt_token_ids) == [10, 11, 12]
    want = hf.generate(torch.tensor([[10, 11, 12]]), do_sample=False, max_new_tokens=6)[
        0, 3:
    ].tolist()
    assert list(out.outputs[0].token_ids) == want
    assert out.outputs[0].text.split() == [f"w{i}" for i in want]
    chat = llm.chat([{"role": "user", "content": "w10 w11"}], params)[0]
    assert list(chat.prompt_token_ids) == [3, 10, 11, 4, 5]


@pytest.mark.parametrize(
    "config",
    [
        LlamaConfig(**TINY),
        OPTConfig(
            hidden_size=64, ffn_dim=128, num_hidden_layers=1, num_attention_heads=4, vocab_size=1000
        ),
    ],
)
def test_directory_without_tokenizer_serves_token_ids(config, tmp_path, caplog):
    save_tiny(config, tmp_path)
    assert not has_tokenizer_files(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert load_tokenizer(tmp_path) is None
    assert "only prompt_token_ids input will work" in caplog.text
    llm = LLM(str(tmp_path), **SMALL)
    out = llm.generate(
        None, SamplingParams(max_tokens=3, ignore_eos=True), prompt_token_ids=[[5, 6, 7]]
    )
    assert len(out[0].outputs[0].token_ids) == 3


def test_load_log_line_reports_parameters_and_kv_blocks(tmp_path, caplog):
    save_tiny(LlamaConfig(**TINY), tmp_path)
    with caplog.at_level(logging.INFO):
        LLM(str(tmp_path), **SMALL)
    line = next(r.getMessage() for r in caplog.records if "KV blocks" in r.getMessage())
    assert "parameters" in line and "torch.float32" in line and "GiB of weights" in line
    assert "32 KV blocks of 16 tokens" in line


def test_pickle_weights_are_refused(tmp_path):
    hf = save_tiny(LlamaConfig(**TINY), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="unpickling can run arbitrary code"):
        LLM(str(tmp_path), **SMALL)


def test_unsupported_architecture_names_it_and_the_supported_list(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({**TINY, "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        LLM(str(tmp_path), **SMALL)
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "OPTForCausalLM"):
        assert arch in str(err.value)


def test_missing_and_unexpected_weights_are_errors(tmp_path):
    save_tiny(LlamaConfig(**TINY), tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    save_file(
        {k: v for k, v in state.items() if "layers.1.self_attn.k_proj" not in k},
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(
        ValueError, match=r"missing from checkpoint.*layers\.1\.self_attn\.qkv_proj"
    ):
        LLM(str(tmp_path), **SMALL)
    save_file({**state, "model.extra.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected weight 'model.extra.weight'"):
        LLM(str(tmp_path), **SMALL)


def test_unknown_model_lists_the_presets():
    with pytest.raises(FileNotFoundError, match="never downloads") as err:
        resolve_model_dir("meta-llama/Llama-2-7b-hf")
    assert "llama3-8b" in str(err.value)


def test_gguf_file_loads_like_transformers_reads_it(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    llm = LLM(str(gguf), load_format="gguf", **SMALL)
    converted = resolve_model_dir(str(gguf))
    assert converted.parent == tmp_path / "cache" / "models"
    assert has_tokenizer_files(converted)  # the GGUF's vocabulary travels along
    hf = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    assert greedy_compare(hf, llm, prompts(1000, lengths=(4, 19)), max_tokens=8).exact >= 1
    # The conversion is cached: a second start reads safetensors, and load_format must fit.
    assert resolve_model_dir(str(gguf)) == converted
    save_tiny(LlamaConfig(**TINY), tmp_path / "hf")
    with pytest.raises(ValueError, match="needs a .gguf file"):
        LLM(str(tmp_path / "hf"), load_format="gguf", **SMALL)
