"""The tiny random Llamas the tests run on, by name. ``tiny_llama`` (tests/conftest.py) writes
TINY_LLAMA with a test's fields over it, once per shape per session; a shape used in several
files is named here, so those files share one directory and one reason."""

from __future__ import annotations

# The tiny Llama most engine tests share (token ids in and out, no tokenizer).
TINY_LLAMA = dict(
    vocab_size=1000,
    max_position_embeddings=256,
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
)

# Text in and out: the embedded model's tokenizer (so its vocabulary and BOS/EOS ids) and tied
# embeddings, as SmolLM2 has. The structured-output tests need real text.
TEXT = dict(
    tokenizer=True, vocab_size=49152, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2
)

# Heads of 64 (4 query, 2 KV), a head size the CUDA kernels are built for.
KERNEL_HEADS = dict(hidden_size=256, intermediate_size=512, head_dim=64)
