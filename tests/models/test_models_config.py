"""Config parsing shared by every architecture: rope settings in both transformers
spellings, rotary tables against transformers' own, shapes and sliding windows."""

from __future__ import annotations

import pytest
import torch

from streamkv.layers.rotary import RotaryEmbedding
from streamkv.models.common import (
    ModelShape,
    limit_context_to_window,
    rope_settings,
    sliding_window,
)

LLAMA31_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}


def test_rope_settings_read_both_transformers_spellings():
    v4 = {"rope_theta": 500000.0, "rope_scaling": LLAMA31_SCALING}
    v5 = {"rope_parameters": {"rope_theta": 500000.0, **LLAMA31_SCALING}}
    for config in (v4, v5):
        theta, scaling = rope_settings(config)
        assert theta == 500000.0 and scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
    assert rope_settings({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}) == (
        1e6,
        None,
    )
    assert rope_settings({"rope_theta": 1e4, "rope_scaling": None}) == (1e4, None)
    assert rope_settings({}) == (10000.0, None)


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            **{k: v for k, v in LLAMA31_SCALING.items() if k != "rope_type"},
        },
    ],
    ids=["default", "linear", "llama3"],
)
def test_rotary_tables_match_transformers(params):
    """Llama 3.1's 128-dim heads, 131072 positions: the cos/sin table equals transformers'."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        max_position_embeddings=131072,
        rope_parameters=params,
    )
    hf = LlamaRotaryEmbedding(config)
    positions = torch.tensor([0, 1, 17, 4095, 8191, 8192, 20000, 131071])
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions[None])
    theta, scaling = rope_settings(config.to_dict())
    ours = RotaryEmbedding(128, 131072, theta, scaling)
    half = 64
    torch.testing.assert_close(ours.cos[positions], cos[0, :, :half], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.sin[positions], sin[0, :, :half], rtol=0, atol=1e-6)


def test_unsupported_rope_scaling_is_an_error():
    with pytest.raises(ValueError, match="'yarn' is not supported"):
        RotaryEmbedding(64, 128, 10000.0, {"rope_type": "yarn", "factor": 4.0})


def test_model_shape_defaults_and_errors():
    opt = ModelShape.from_config(
        {
            "model_type": "opt",
            "vocab_size": 50272,
            "hidden_size": 768,
            "ffn_dim": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "max_position_embeddings": 2048,
        }
    )
    assert (opt.intermediate_size, opt.num_kv_heads, opt.head_dim, opt.norm_eps) == (
        3072,
        12,
        64,
        1e-5,
    )
    mistral_nemo = ModelShape.from_config(
        {
            "vocab_size": 131072,
            "hidden_size": 5120,
            "head_dim": 128,
            "intermediate_size": 14336,
            "num_hidden_layers": 40,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-5,
        }
    )
    assert mistral_nemo.head_dim == 128 and mistral_nemo.norm_eps == 1e-5
    with pytest.raises(ValueError, match="lacks"):
        ModelShape.from_config({"hidden_size": 64})
    with pytest.raises(ValueError, match="KV heads"):
        ModelShape.from_config(
            {
                "vocab_size": 8,
                "hidden_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "num_key_value_heads": 3,
            }
        )


def test_sliding_window_rules():
    base = {"max_position_embeddings": 32768}
    assert sliding_window({**base, "sliding_window": 4096}) == 4096  # Mistral 7B v0.1
    assert sliding_window({**base, "sliding_window": None}) is None  # Mistral v0.2+
    assert (
        sliding_window({**base, "sliding_window": 4096, "use_sliding_window": False}) is None
    )  # Qwen2
    assert (
        sliding_window({**base, "sliding_window": 4096, "layer_types": ["full_attention"] * 4})
        is None
    )
    capped = limit_context_to_window({**base, "sliding_window": 4096})
    assert capped["max_position_embeddings"] == 4096
    wide = {"sliding_window": 131072, "max_position_embeddings": 32768}
    assert limit_context_to_window(wide) is wide  # a window wider than the context changes nothing
