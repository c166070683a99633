"""The decode GEMV (kernels/gemv.py, gemv_cuda.py, kernels_cu/gemv.cu).

CPU: the dispatch runs the references (F.linear; F.linear then silu_and_mul), and the
layers built on it (ParallelLinear, the Llama MLP) equal the unfused torch code. Compile
only (no GPU): every variant for sm_80 and sm_90. CUDA: the kernel against an fp64 product
and against cuBLAS on fresh random inputs (outputs poisoned with NaN first), plain and
SiLU-paired, with biases, strided inputs, odd output counts and every row count; a row's
result does not depend on how many rows run with it; the SiLU pairing equals the plain
kernel followed by the silu_and_mul kernel bit for bit; launched with programmatic
dependent launch inside a CUDA graph after the kernel that writes its input, it reads that
input, not a stale one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from streamkv.kernels import fused, gemv

DTYPES = (torch.float16, torch.bfloat16)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# The production path, and the others bench_decode_gemv.py measures (k split otherwise).
CONFIGS = [gemv.DEFAULT, gemv.GemvConfig(unroll=8, warps=4, pdl=False), gemv.GemvConfig(split_k=8)]


def _rand(*shape, dtype=torch.float32, device="cpu", seed=0, scale=1.0) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)


# -- CPU: the references --------------------------------------------------------------------
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_dispatch_runs_the_references(bias):
    x, w = _rand(1, 64, seed=1), _rand(48, 64, seed=2)
    b = _rand(48, seed=3) if bias else None
    assert torch.equal(gemv.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(
        gemv.linear_silu_and_mul(x, w, b),
        F.silu(F.linear(x, w, b)[:, :24]) * F.linear(x, w, b)[:, 24:],
    )


def test_parallel_linear_silu_and_mul_equals_unfused():
    from streamkv.layers.linear import ParallelLinear

    layer = ParallelLinear(32, [40, 40])
    layer.weight.data.copy_(_rand(80, 32, seed=4))
    x = _rand(3, 32, seed=5)
    full = F.linear(x, layer.weight)
    assert torch.equal(layer(x), full)
    assert torch.equal(layer.silu_and_mul(x), F.silu(full[:, :40]) * full[:, 40:])
    with pytest.raises(ValueError, match="gate/up"):
        ParallelLinear(32, [40, 8]).silu_and_mul(x)


@pytest.mark.parametrize("arch", [80, 90])
def test_gemv_variants_compile(arch, tmp_path, monkeypatch):
    pytest.importorskip("cuda.bindings.nvrtc")
    from streamkv.kernels import gemv_cuda, nvrtc

    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(tmp_path))
    for dtype in ("__half", "__nv_bfloat16"):
        for unroll in (gemv.DEFAULT.unroll,):
            names = gemv_cuda.gemv_names(dtype, unroll)
            compiled = nvrtc.compile_program(gemv_cuda.GEMV_SOURCE, names, arch)
            assert set(compiled.lowered) == set(names)
            for mangled in compiled.lowered.values():
                assert mangled.encode() in compiled.image


def test_pdl_kernels_compile_with_their_waits(tmp_path, monkeypatch):
    # The sm_90 programs carry the griddepcontrol instructions; sm_80 ones compile without.
    pytest.importorskip("cuda.bindings.nvrtc")
    from streamkv.kernels import gemv_cuda, nvrtc

    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(tmp_path))
    names = gemv_cuda.gemv_names("__nv_bfloat16", gemv.DEFAULT.unroll)[:1]

    def ptx(arch: int) -> str:
        opts = [
            f"--gpu-architecture=compute_{arch}",
            *nvrtc._BASE_OPTIONS,
            *(f"-I{d}" for d in (str(nvrtc.KERNELS_DIR), *nvrtc.cuda_include_dirs())),
        ]
        return nvrtc._compile(gemv_cuda.GEMV_SOURCE, names, opts, False).image.decode(
            errors="replace"
        )

    text = ptx(90)
    assert "griddepcontrol.wait" in text and "griddepcontrol.launch_dependents" in text
    assert "griddepcontrol" not in ptx(80)


# -- CUDA: the kernel against references -----------------------------------------------------
def _poisoned(m: int, n: int, dtype) -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=dtype, device="cuda")


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN: an output was never written"
    return float((out.double() - ref.double()).norm() / ref.double().norm())


# (m, n, k): llama-like widths, a k that is no whole number of a warp's vector chunks,
# odd n (the last warp has one row), tiny k (one vector per row).
SHAPES = [(1, 1024, 4096), (2, 777, 4096), (3, 96, 14336), (4, 33, 264), (1, 5, 8), (4, 4096, 1024)]


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("config", CONFIGS)
def test_gemv_against_fp64_and_cublas(dtype, m, n, k, bias, config):
    from streamkv.kernels import gemv_cuda

    x, w = (
        _rand(m, k, dtype=dtype, device="cuda", seed=m + n),
        _rand(n, k, dtype=dtype, device="cuda", seed=k),
    )
    b = _rand(n, dtype=dtype, device="cuda", seed=7) if bias else None
    out = gemv_cuda.gemv(x, w, b, silu=False, config=config, out=_poisoned(m, n, dtype))
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert _rel(out, exact) < 4e-3  # one rounding to the dtype
    assert _rel(out, F.linear(x, w, b)) < 8e-3


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("config", CONFIGS)
def test_gemv_silu_pairs_equal_plain_then_silu_kernel(dtype, m, n, k, bias, config):
    from streamkv.kernels import gemv_cuda

    x, w = (
        _rand(m, k, dtype=dtype, device="cuda", seed=n),
        _rand(2 * n, k, dtype=dtype, device="cuda", seed=k + 1),
    )
    b = _rand(2 * n, dtype=dtype, device="cuda", seed=8) if bias else None
    fused_out = gemv_cuda.gemv(x, w, b, silu=True, config=config, out=_poisoned(m, n, dtype))
    plain = gemv_cuda.gemv(x, w, b, silu=False, config=config)
    assert torch.equal(fused_out, fused.silu_and_mul(plain))
    ref = fused.silu_and_mul_ref(
        F.linear(x.double(), w.double(), None if b is None else b.double())
    )
    assert _rel(fused_out, ref) < 1e-2


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", CONFIGS)
def test_rows_do_not_depend_on_their_batch(dtype, config):
    # Strided x (rows of a wider buffer) and m = 1..4 through every M variant: each row
    # equals the same row computed alone, bit for bit.
    from streamkv.kernels import gemv_cuda

    wide = _rand(4, 4096 + 64, dtype=dtype, device="cuda", seed=11)
    x = wide[:, :4096]
    w = _rand(3000, 4096, dtype=dtype, device="cuda", seed=12)
    alone = torch.cat(
        [gemv_cuda.gemv(x[i : i + 1], w, None, silu=False, config=config) for i in range(4)]
    )
    for m in (2, 3, 4):
        assert torch.equal(gemv_cuda.gemv(x[:m], w, None, silu=False, config=config), alone[:m])


@cuda
def test_dispatch_on_cuda():
    # Kernel for 1..max_rows rows of a supported layout; cuBLAS for the rest (fp32, more rows,
    # a k that is no whole number of vectors), with its exact result.
    x, w = (
        _rand(6, 4096, dtype=torch.bfloat16, device="cuda"),
        _rand(256, 4096, dtype=torch.bfloat16, device="cuda"),
    )
    assert torch.equal(gemv.linear(x, w), F.linear(x, w))  # 6 rows > max_rows
    assert torch.equal(gemv.linear(x.float(), w.float()), F.linear(x.float(), w.float()))
    odd_x, odd_w = x[:1, :4092], _rand(256, 4092, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(gemv.linear(odd_x, odd_w), F.linear(odd_x, odd_w))
    off = gemv.GemvConfig(max_rows=0)
    assert torch.equal(gemv.linear(x[:1], w, config=off), F.linear(x[:1], w))
    assert _rel(gemv.linear(x[:1], w), F.linear(x[:1], w)) < 8e-3


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_pdl_launch_in_a_graph_reads_the_fresh_input(dtype):
    """RMSNorm writes x, the PDL-launched GEMV reads it: replays after new inputs give the
    eager results, so the GEMV's weight loads ran early but its read of x waited."""
    from streamkv.kernels import gemv_cuda, launch

    if launch.arch(torch.device("cuda")) < 90:
        pytest.skip("programmatic dependent launch needs sm_90")
    hidden, n = 4096, 14336
    src = _rand(1, hidden, dtype=dtype, device="cuda", seed=20)
    norm_w = _rand(hidden, dtype=dtype, device="cuda", seed=21, scale=0.1) + 1
    w = _rand(2 * n, hidden, dtype=dtype, device="cuda", seed=22)
    w2 = _rand(hidden, n, dtype=dtype, device="cuda", seed=23)
    pdl = gemv.GemvConfig(pdl=True)

    def step():
        h = fused.rms_norm(src, norm_w, 1e-6)
        a = gemv_cuda.gemv(h, w, None, silu=True, config=pdl)
        return gemv_cuda.gemv(a, w2, None, silu=False, config=pdl)

    want = []
    for seed in (30, 31, 32):
        src.copy_(_rand(1, hidden, dtype=dtype, device="cuda", seed=seed))
        want.append(step().clone())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: compile and load outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed, expected in zip((30, 31, 32), want, strict=True):
        src.copy_(_rand(1, hidden, dtype=dtype, device="cuda", seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


@cuda
def test_tiny_llama_bf16_with_and_without_the_gemv(tiny_llama, monkeypatch):
    """A decode step's logits with the GEMV (batch 1: every projection, the MLP's
    activation and the lm_head) and with cuBLAS: bf16 rounding apart, nothing more."""
    from streamkv.entrypoints.llm import LLM
    from streamkv.worker.input_batch import SampleRequest, SeqInput
    from tests.tiny_models import KERNEL_HEADS

    llm = LLM(
        str(tiny_llama(**KERNEL_HEADS, vocab_size=500, max_position_embeddings=2048)),
        device="cuda",
        dtype="bfloat16",
        num_kv_blocks=64,
        num_swap_blocks=0,
        enforce_eager=True,
    )
    worker = llm.engine.executor.worker
    runner, kv = worker.runner, worker.cache.device_cache
    prompt = SeqInput(0, list(range(3, 40)), 0, [0, 1, 2], SampleRequest())
    decode = SeqInput(0, [7], 37, [0, 1, 2], SampleRequest())
    from streamkv.kernels import gemv_cuda

    calls = []
    real = gemv_cuda.gemv
    monkeypatch.setattr(
        gemv_cuda, "gemv", lambda *a, **kw: calls.append(kw["silu"]) or real(*a, **kw)
    )

    def logits() -> torch.Tensor:
        with torch.inference_mode():
            runner.forward([prompt], kv)
            return worker.model.compute_logits(runner.forward([decode], kv)[0])

    with_gemv = logits()
    assert calls.count(True) == 2  # the decode step's two MLPs, activation fused
    calls.clear()
    monkeypatch.setattr(gemv, "DEFAULT", gemv.GemvConfig(max_rows=0))
    with_cublas = logits()
    assert not calls
    assert _rel(with_gemv, with_cublas) < 2e-2
