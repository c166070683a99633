"""Built-in shape presets and dummy weights. The big shapes are built on the "meta" device
(no memory) and compared with transformers' own model of the same config; only
smollm2-135m is materialised."""

from __future__ import annotations

import json
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from streamkv import SamplingParams
from streamkv.entrypoints.llm import LLM
from streamkv.layers.linear import ParallelLinear
from streamkv.layers.norm import RMSNorm
from streamkv.model_info import check_tensor_parallel
from streamkv.models.common import ModelShape
from streamkv.models.loader import PRESETS_DIR, load_config, presets, resolve_model_dir
from streamkv.models.registry import build_model, num_parameters, parameter_bytes
from streamkv.worker.cache_engine import kv_bytes_per_block

# name: (layers, hidden, heads, kv heads, head_dim, mlp width, vocab, max positions, parameters)
EXPECTED = {
    "llama3-8b": (32, 4096, 32, 8, 128, 14336, 128256, 8192, 8_030_261_248),
    "llama2-13b": (40, 5120, 40, 40, 128, 13824, 32000, 4096, 13_015_864_320),
    "opt-13b": (40, 5120, 40, 40, 128, 20480, 50272, 2048, 12_853_473_280),
    "opt-66b": (64, 9216, 72, 72, 128, 36864, 50272, 2048, 65_719_701_504),
    # 96 x (12h^2 + 13h) + token and position embeddings + final norm, h = 12288.
    "opt-175b": (96, 12288, 96, 96, 128, 49152, 50272, 2048, 174_604_468_224),
    "smollm2-135m": (30, 576, 9, 3, 64, 1536, 49152, 8192, 134_515_008),
}


def test_presets_ship_in_the_package():
    assert presets() == sorted(EXPECTED)
    for name in EXPECTED:
        assert resolve_model_dir(name) == PRESETS_DIR / name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_shape_matches_the_public_model(name):
    config = load_config(resolve_model_dir(name))
    s = ModelShape.from_config(config)
    layers, hidden, heads, kv, head_dim, mlp, vocab, positions, params = EXPECTED[name]
    assert (s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim) == (
        layers,
        hidden,
        heads,
        kv,
        head_dim,
    )
    assert (s.intermediate_size, s.vocab_size, s.max_positions) == (mlp, vocab, positions)
    model = build_model(resolve_model_dir(name), torch.bfloat16, torch.device("meta"), "dummy")
    assert num_parameters(model) == params


@pytest.mark.parametrize("name", ["llama3-8b", "opt-13b"])
def test_preset_matches_transformers_parameter_for_parameter(name):
    """Same parameter count as transformers' model of the config, and every fused
    streamkv matrix holds exactly the transformers matrices it replaces."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(PRESETS_DIR / name)))
    ours = build_model(PRESETS_DIR / name, torch.bfloat16, torch.device("meta"), "dummy")
    assert num_parameters(hf) == num_parameters(ours)
    hf_shapes = {
        k.removeprefix("model.").removeprefix("decoder."): v.shape for k, v in hf.named_parameters()
    }
    ours_shapes = dict(ours.named_parameters())
    q, k, v = (hf_shapes[f"layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    assert ours_shapes["layers.0.self_attn.qkv_proj.weight"].shape == (q[0] + k[0] + v[0], q[1])


# The paper's tensor-parallel runs: every one must split into whole heads and even MLP slices.
TP_RUNS = [("llama2-13b", 2), ("opt-66b", 4), ("opt-66b", 8), ("opt-175b", 4), ("opt-175b", 8)]


@pytest.mark.parametrize(("name", "tp"), TP_RUNS)
def test_big_presets_shard_evenly(name, tp):
    """Built on "meta" at TP 1 and as rank ``tp - 1`` of ``tp``: every sharded matrix is exactly
    1/tp of the whole one, the rest (embeddings, norms) is replicated, and a rank's KV block
    holds 1/tp of the heads."""
    config = load_config(resolve_model_dir(name))
    check_tensor_parallel(config, tp)
    meta = torch.device("meta")
    full = build_model(resolve_model_dir(name), torch.bfloat16, meta, "dummy")
    shard = build_model(
        resolve_model_dir(name), torch.bfloat16, meta, "dummy", tp_rank=tp - 1, tp_size=tp
    )
    whole = dict(full.named_modules())
    sharded = replicated = 0
    for mod_name, module in shard.named_modules():
        if isinstance(module, ParallelLinear):
            assert module.weight.numel() * tp == whole[mod_name].weight.numel(), mod_name
            sharded += whole[mod_name].weight.numel()
        elif isinstance(module, torch.nn.Embedding):
            assert module.weight.shape == whole[mod_name].weight.shape, mod_name
            replicated += module.weight.numel()
    assert sharded + replicated > 0.99 * num_parameters(full)
    s = ModelShape.from_config(config)
    per_rank = kv_bytes_per_block(
        s.num_layers, s.num_kv_heads // tp, s.head_dim, 16, torch.bfloat16
    )
    assert per_rank * tp == kv_bytes_per_block(
        s.num_layers, s.num_kv_heads, s.head_dim, 16, torch.bfloat16
    )


def test_opt_175b_fits_eight_h200s_in_bf16():
    """Rank 0's weights at TP 8: 1/8 of the layers plus the replicated embeddings, 41.7 GiB."""
    shard = build_model(
        resolve_model_dir("opt-175b"),
        torch.bfloat16,
        torch.device("meta"),
        "dummy",
        tp_rank=0,
        tp_size=8,
    )
    gib = parameter_bytes(shard) / 2**30
    assert 40 < gib < 42


class _LiveBytes(TorchDispatchMode):
    """Bytes of the tensors alive right now that ops created on ``device``, and their peak."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device, self.live, self.peak, self.other_devices = device, 0, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            if t.device.type != self.device:
                self.other_devices.add(str(t.device))
            elif t._base is None and func._schema.name.split("::")[1].startswith(
                ("empty", "new_", "zeros", "ones")
            ):
                n = t.untyped_storage().nbytes()
                self.live += n
                self.peak = max(self.peak, self.live)
                weakref.finalize(t.untyped_storage(), self._free, n)
        return out

    def _free(self, n: int) -> None:
        self.live -= n


def test_dummy_weights_of_a_shard_are_built_in_place_one_matrix_at_a_time(tmp_path):
    """A rank builds its dummy shard on its own device: at no time does it hold more than its
    shard plus one whole logical matrix (drawn whole so that every TP size gives the same
    model, then sliced). No full-size copy of the model exists anywhere, host or device."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 4096,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    full_bytes = parameter_bytes(
        build_model(tmp_path, torch.float32, torch.device("meta"), "dummy")
    )
    largest = 4096 * 256 * 4  # the embedding / lm_head matrix, float32
    watch = _LiveBytes("cpu")
    with watch:
        shard = build_model(
            tmp_path, torch.float32, torch.device("cpu"), "dummy", tp_rank=1, tp_size=2
        )
    shard_bytes = parameter_bytes(shard)
    assert shard_bytes < 0.6 * full_bytes and not watch.other_devices
    assert watch.peak <= shard_bytes + largest, (watch.peak, shard_bytes, full_bytes)


def test_llama3_8b_kv_block_size():
    s = ModelShape.from_config(load_config(resolve_model_dir("llama3-8b")))
    # 2 (K and V) x 32 layers x 8 KV heads x 128 dims x 16 tokens x 2 bytes = 2 MiB.
    assert (
        kv_bytes_per_block(s.num_layers, s.num_kv_heads, s.head_dim, 16, torch.bfloat16)
        == 2 * 2**20
    )


@pytest.mark.slow
def test_smollm2_preset_runs_on_dummy_weights():
    """A preset implies dummy weights and no tokenizer: token ids in, token ids out."""
    llm = LLM("smollm2-135m", device="cpu", dtype="float32", num_kv_blocks=16, num_swap_blocks=0)
    assert llm.get_tokenizer() is None
    model = llm.engine.executor.worker.model
    emb = model.embed_tokens.weight
    assert 0.015 < float(emb[:1000].std()) < 0.025  # N(0, 0.02), drawn in place
    assert all(
        torch.equal(m.weight, torch.ones_like(m.weight))
        for m in model.modules()
        if isinstance(m, RMSNorm)
    )
    out = llm.generate(
        None, SamplingParams(max_tokens=4, ignore_eos=True), prompt_token_ids=[[1, 2, 3]]
    )
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="this model has no tokenizer"):
        llm.generate("hello", SamplingParams(max_tokens=1))


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "OPTForCausalLM"])
def test_dummy_weights_of_a_directory_config_are_seeded_and_fill_everything(arch, tmp_path):
    """load_format="dummy" on any config.json (no weight files needed)."""
    config = {
        "architectures": [arch],
        "model_type": "opt" if arch.startswith("OPT") else "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "ffn_dim": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 500,
        "max_position_embeddings": 64,
        "word_embed_proj_dim": 32,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    a = build_model(tmp_path, torch.float32, torch.device("cpu"), "dummy", seed=1)
    b = build_model(tmp_path, torch.float32, torch.device("cpu"), "dummy", seed=1)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
        if "norm" in name:  # norms stay at ones / zeros
            assert torch.equal(
                p, torch.ones_like(p) if name.endswith("weight") else torch.zeros_like(p)
            ), name
        else:
            assert bool(torch.isfinite(p).all()) and float(p.abs().max()) > 0, name


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "OPTForCausalLM"])
def test_dummy_weights_are_the_same_model_at_every_tensor_parallel_size(arch, tmp_path):
    """Each rank's dummy shard is exactly its slice of the TP=1 dummy model, so TP=2 and
    TP=1 runs of a preset can be compared token for token."""
    config = {
        "architectures": [arch],
        "model_type": "opt" if arch.startswith("OPT") else "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "ffn_dim": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 500,
        "max_position_embeddings": 64,
        "attention_bias": True,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    full = build_model(tmp_path, torch.float32, torch.device("cpu"), "dummy", seed=3)
    full_modules = dict(full.named_modules())
    for rank in range(2):
        shard = build_model(
            tmp_path, torch.float32, torch.device("cpu"), "dummy", tp_rank=rank, tp_size=2, seed=3
        )
        for name, module in shard.named_modules():
            ref = full_modules[name]
            if isinstance(module, ParallelLinear):
                parts = ref.weight.split(ref.out_splits)
                want = torch.cat([module.shard(p, i) for i, p in enumerate(parts)])
                assert torch.equal(module.weight, want), (rank, name)
                if module.bias is not None:
                    parts = ref.bias.split(ref.out_splits)
                    assert torch.equal(
                        module.bias, torch.cat([module.shard(p, i) for i, p in enumerate(parts)])
                    )
            elif isinstance(module, torch.nn.Embedding):
                assert torch.equal(module.weight, ref.weight), (rank, name)


def test_preset_refuses_a_weight_format():
    with pytest.raises(ValueError, match="only supports load_format='dummy'"):
        LLM("llama3-8b", device="cpu", load_format="safetensors")
