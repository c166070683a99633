"""The fused elementwise ops (kernels/fused.py, kernels_cu/fused_ops.cu).

CPU: each reference equals, bit for bit, the unfused computation transformers runs (its
RMSNorm, rotary and MLP code, nn.LayerNorm), in place where the op is in place; the layers
dispatch to the references off the GPU. Compile-only (no GPU): every kernel variant for
sm_80 and sm_90. CUDA: each kernel against its reference on fresh random rows (strided
rows sit between NaN columns a stray access would pick up), in both access widths (16-byte
vectors and scalars) and on strided
rows; a tiny Llama and OPT give the same logits with the kernels as with the references.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from streamkv.kernels import fused

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Max abs error per unit of magnitude: the kernels reduce in another order than torch, and
# one flipped rounding of a norm output is one ulp of the dtype.
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rows(tokens: int, hidden: int, dtype, device="cpu", seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(tokens, hidden, generator=gen, device=device) * 2).to(dtype)


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' LlamaRMSNorm.forward, spelled out.
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


def _hf_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # transformers' apply_rotary_pos_emb on a [T, H, D] tensor, float32 tables of width D.
    def rotate_half(t):
        half = t.shape[-1] // 2
        return torch.cat((-t[..., half:], t[..., :half]), dim=-1)

    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


# -- CPU: the references are the unfused computation ---------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_references_equal_unfused(dtype):
    x, res = _rows(5, 64, dtype, seed=1), _rows(5, 64, dtype, seed=2)
    w = 1 + 0.1 * _rows(1, 64, dtype, seed=3)[0]
    assert torch.equal(fused.rms_norm(x, w, 1e-6), _hf_rms_norm(x, w, 1e-6))
    want_res = res + x
    want = _hf_rms_norm(want_res, w, 1e-6)
    fused.fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(res, want_res) and torch.equal(x, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", [True, False])
def test_add_layer_norm_reference_equals_unfused(dtype, affine):
    x, res = _rows(4, 48, dtype, seed=4), _rows(4, 48, dtype, seed=5)
    ln = torch.nn.LayerNorm(48, eps=1e-5, elementwise_affine=affine, dtype=dtype)
    if affine:
        with torch.no_grad():
            ln.weight.copy_(1 + 0.1 * _rows(1, 48, dtype, seed=6)[0])
            ln.bias.copy_(0.1 * _rows(1, 48, dtype, seed=7)[0])
    want_res = res + x
    with torch.no_grad():
        want = ln(want_res)
        fused.fused_add_layer_norm(x, res, ln.weight, ln.bias, 1e-5)
    assert torch.equal(res, want_res) and torch.equal(x, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_reference_equals_transformers_in_place(dtype):
    from streamkv.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(64, 256, 10000.0)
    positions = torch.tensor([0, 1, 5, 200, 255, 3])
    qkv = _rows(6, 3 * 4 * 64, dtype, seed=8).view(6, 12, 64)  # q, k, v heads side by side
    q, k, v = qkv[:, :4], qkv[:, 4:8], qkv[:, 8:]
    cos = torch.cat((rope.cos, rope.cos), -1)[positions].unsqueeze(1)
    sin = torch.cat((rope.sin, rope.sin), -1)[positions].unsqueeze(1)
    want_q, want_k, want_v = _hf_rotary(q, cos, sin), _hf_rotary(k, cos, sin), v.clone()
    out_q, out_k = rope(positions, q, k)
    assert out_q.data_ptr() == q.data_ptr()  # in place, in the projection's output
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(v, want_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_reference_equals_unfused(dtype):
    x = _rows(3, 2 * 40, dtype, seed=9)
    assert torch.equal(fused.silu_and_mul(x), F.silu(x[:, :40]) * x[:, 40:])


def test_layers_run_the_references_off_the_gpu(monkeypatch):
    from streamkv.layers.norm import LayerNorm, RMSNorm

    calls: list[str] = []
    for name in ("rms_norm_ref", "fused_add_rms_norm_ref", "fused_add_layer_norm_ref"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    x, res = _rows(2, 32, torch.float32), _rows(2, 32, torch.float32, seed=1)
    norm = RMSNorm(32, 1e-6)
    norm(x)
    out, r = norm(x.clone(), res.clone())
    assert r.data_ptr() != res.data_ptr() and torch.equal(r, res + x)
    LayerNorm(32, 1e-5)(x.clone(), res.clone())
    assert calls == [
        "rms_norm_ref",
        "fused_add_rms_norm_ref",
        "rms_norm_ref",
        "fused_add_layer_norm_ref",
    ]


# -- compile only (CI): every variant for both architectures --------------------------------
@pytest.mark.parametrize("arch", [80, 90])
def test_fused_variants_compile(arch, tmp_path, monkeypatch):
    pytest.importorskip("cuda.bindings.nvrtc")
    from streamkv.kernels import fused_cuda, nvrtc

    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(tmp_path))
    for dtype in ("float", "__half", "__nv_bfloat16"):
        names = fused_cuda.fused_names(dtype)
        assert len(names) == 2 * len(fused_cuda.TEMPLATES)
        compiled = nvrtc.compile_program(fused_cuda.FUSED_SOURCE, names, arch)
        assert set(compiled.lowered) == set(names)
        for mangled in compiled.lowered.values():
            assert mangled.encode() in compiled.image


# -- CUDA: kernels against references --------------------------------------------------------
def _close(out: torch.Tensor, ref: torch.Tensor, dtype) -> None:
    assert not torch.isnan(out).any(), "NaN: an element was never written"
    err = (out.double() - ref.double()).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, ref.double().abs().max().item()), err


def _strided(t: torch.Tensor, extra: int) -> torch.Tensor:
    """The same values as rows of a wider buffer (row stride > width), the rest NaN."""
    wide = torch.full(
        (t.shape[0], t.shape[1] + extra), float("nan"), dtype=t.dtype, device=t.device
    )
    wide[:, : t.shape[1]] = t
    return wide[:, : t.shape[1]]


# (tokens, hidden, extra columns per row): 16-byte vectors; scalar rows (hidden 100 is no
# whole number of vectors); strided rows (vectors, then an odd stride that forces scalars).
SHAPES = [(1, 4096, 0), (37, 4096, 0), (300, 896, 0), (5, 100, 0), (9, 512, 8), (9, 512, 3)]


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden,extra", SHAPES)
def test_rms_norm_kernels(dtype, tokens, hidden, extra):
    x = _strided(_rows(tokens, hidden, dtype, "cuda", 1), extra)
    res = _strided(_rows(tokens, hidden, dtype, "cuda", 2), extra)
    w = 1 + 0.1 * _rows(1, hidden, dtype, "cuda", 3)[0]
    _close(fused.rms_norm(x, w, 1e-5), fused.rms_norm_ref(x, w, 1e-5), dtype)
    want_x, want_res = x.clone(), res.clone()
    fused.fused_add_rms_norm_ref(want_x, want_res, w, 1e-5)
    fused.fused_add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(res, want_res)  # one rounded add: exact
    _close(x, want_x, dtype)


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden,extra", SHAPES)
@pytest.mark.parametrize("affine", [True, False])
def test_add_layer_norm_kernel(dtype, tokens, hidden, extra, affine):
    x = _strided(_rows(tokens, hidden, dtype, "cuda", 4), extra)
    res = _strided(_rows(tokens, hidden, dtype, "cuda", 5), extra) + 3  # a mean to remove
    w = (1 + 0.1 * _rows(1, hidden, dtype, "cuda", 6)[0]) if affine else None
    b = (0.1 * _rows(1, hidden, dtype, "cuda", 7)[0]) if affine else None
    want_x, want_res = x.clone(), res.clone()
    fused.fused_add_layer_norm_ref(want_x, want_res, w, b, 1e-5)
    fused.fused_add_layer_norm(x, res, w, b, 1e-5)
    assert torch.equal(res, want_res)
    _close(x, want_x, dtype)


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head,q_heads,k_heads", [(128, 32, 8), (64, 4, 2), (80, 5, 5), (6, 2, 1)])
def test_rotary_kernel_in_place(dtype, head, q_heads, k_heads):
    from streamkv.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(head, 8192, 500000.0, device="cuda")
    tokens = 23
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    width = (q_heads + 2 * k_heads) * head
    qkv = _rows(tokens, width, dtype, "cuda", 8).view(tokens, -1, head)
    q, k = qkv[:, :q_heads], qkv[:, q_heads : q_heads + k_heads]
    v_before = qkv[:, q_heads + k_heads :].clone()
    want_q, want_k = q.clone(), k.clone()
    fused.rotary_embedding_ref(positions, want_q, want_k, rope.cos, rope.sin)
    fused.rotary_embedding(positions, q, k, rope.cos, rope.sin)
    # Products and sums rounded one by one, as torch's separate ops do: bitwise equal.
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, q_heads + k_heads :], v_before)


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "tokens,inter,extra", [(1, 14336, 0), (64, 1536, 0), (7, 100, 0), (5, 512, 3)]
)
def test_silu_and_mul_kernel(dtype, tokens, inter, extra):
    x = _strided(_rows(tokens, 2 * inter, dtype, "cuda", 9), extra)
    _close(fused.silu_and_mul(x), fused.silu_and_mul_ref(x), dtype)


@cuda
@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_models_with_kernels_equal_references(arch, tiny_llama, tmp_path, monkeypatch):
    """Logits of a prompt step and a decode step of a tiny model with the kernels and with
    every op forced to its reference (both on the GPU, fp32: only reduction order differs)."""
    from transformers import OPTConfig

    from streamkv.entrypoints.llm import LLM
    from streamkv.worker.input_batch import SampleRequest, SeqInput
    from tests.models.hf_tiny import save_tiny
    from tests.tiny_models import KERNEL_HEADS

    if arch == "llama":
        path = tiny_llama(**KERNEL_HEADS, vocab_size=500, max_position_embeddings=2048)
    else:
        path = tmp_path
        opt = OPTConfig(
            vocab_size=500,
            hidden_size=256,
            ffn_dim=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=256,
        )
        save_tiny(opt, path)
    llm = LLM(
        str(path),
        device="cuda",
        dtype="float32",
        num_kv_blocks=64,
        num_swap_blocks=0,
        enforce_eager=True,
    )
    worker = llm.engine.executor.worker
    runner, kv = worker.runner, worker.cache.device_cache
    prompt = SeqInput(0, list(range(3, 40)), 0, [0, 1, 2], SampleRequest())
    decode = SeqInput(0, [7], 37, [0, 1, 2], SampleRequest())

    def logits() -> list[torch.Tensor]:
        with torch.inference_mode():
            return [
                worker.model.compute_logits(runner.forward([s], kv)[0]) for s in (prompt, decode)
            ]

    with_kernels = logits()
    monkeypatch.setattr(fused, "_kernel_ok", lambda *tensors: False)
    with_refs = logits()
    for a, b in zip(with_kernels, with_refs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
