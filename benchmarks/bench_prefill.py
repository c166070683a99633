"""Prefill on one GPU: the paged varlen prefill kernel, and the engine's prompt throughput.

(a) Kernel: ops.paged_attention_prefill_varlen over random block tables against torch's
    flash SDPA on the same tokens laid out contiguously (causal; a chunk after a cached
    prefix uses SDPA's lower-right causal mask), CUDA-graph replays behind a spin kernel
    (benchmarks/bench_kernels.gpu_time_ms), outputs checked against each other.
(b) End to end: the engine (llama3-8b preset, dummy bf16 weights, max_tokens=1) on
    64 x 4000 and 256 x 500 random-token prompts against plain transformers' contiguous
    forward (LlamaForCausalLM from the same config, random bf16 weights, sdpa, logits for the
    last token only) on the same prompts in the same run; prompt tokens/s, the ratio, and
    the fraction of the matmul roofline (2 x params x tokens FLOP at --peak-tflops).

    python benchmarks/bench_prefill.py --kernel-only --out prefill_kernel.json
    python benchmarks/bench_prefill.py --e2e-only --out prefill_e2e.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    batch: int
    q_len: int
    prefix: int  # cached tokens before each span
    heads: int
    kv_heads: int
    head: int
    block: int = 16


SHAPES = (
    Shape("llama3-8b 4k", 4, 4096, 0, 32, 8, 128),
    Shape("llama3-8b 16x1k", 16, 1024, 0, 32, 8, 128),
    Shape("llama3-8b 256x500", 256, 500, 0, 32, 8, 128),
    Shape("llama3-8b chunk 512 @3.5k", 8, 512, 3584, 32, 8, 128),
    Shape("opt-13b 2k (MHA)", 4, 2048, 0, 40, 40, 128),
    Shape("head 64 4k", 4, 4096, 0, 32, 8, 64),
    Shape("head 256 4k", 2, 4096, 0, 16, 8, 256),
    Shape("llama3-8b 4k block 256", 4, 4096, 0, 32, 8, 128, 256),
    Shape("llama3-8b 1x16k", 1, 16384, 0, 32, 8, 128),
    Shape("GQA 8 (64/8) 4k", 2, 4096, 0, 64, 8, 128),
)


def causal_flop(s: Shape) -> float:
    keys = s.q_len * s.prefix + s.q_len * (s.q_len + 1) / 2  # summed over a span's rows
    return 4.0 * s.batch * s.heads * s.head * keys


def paged_copy(k: torch.Tensor, block: int, gen: torch.Generator):
    """[B, Hkv, T, D] -> a pool [blocks, Hkv, block, D] under random block tables."""
    b, kvh, t, d = k.shape
    per = -(-t // block)
    perm = torch.randperm(b * per, generator=gen, device=k.device)
    tables = perm.view(b, per).to(torch.int32)
    pool = torch.zeros((b * per, kvh, block, d), dtype=k.dtype, device=k.device)
    pos = torch.arange(t, device=k.device)
    for i in range(b):
        pool[tables[i, pos // block].long(), :, pos % block] = k[i].transpose(0, 1)
    return pool, tables


def bench_kernel(s: Shape, iters: int, tile=None) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from benchmarks.bench_kernels import gpu_time_ms, rel_err
    from streamkv.kernels import ops, prefill

    gen = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    ctx = s.prefix + s.q_len
    q = torch.randn((s.batch, s.heads, s.q_len, s.head), generator=gen, device="cuda", dtype=dt)
    k = torch.randn((s.batch, s.kv_heads, ctx, s.head), generator=gen, device="cuda", dtype=dt)
    v = torch.randn((s.batch, s.kv_heads, ctx, s.head), generator=gen, device="cuda", dtype=dt)
    key_cache, tables = paged_copy(k, s.block, gen)
    value_cache = torch.zeros_like(key_cache)
    pos = torch.arange(ctx, device="cuda")
    for i in range(s.batch):
        value_cache[tables[i, pos // s.block].long(), :, pos % s.block] = v[i].transpose(0, 1)
    rows = q.transpose(1, 2).reshape(s.batch * s.q_len, s.heads, s.head).contiguous()
    cu = torch.arange(0, s.batch + 1, device="cuda", dtype=torch.int32) * s.q_len
    lens = torch.full((s.batch,), ctx, device="cuda", dtype=torch.int32)
    out = torch.empty_like(rows)
    scale = s.head**-0.5

    def ours():
        if tile is None:
            ops.paged_attention_prefill_varlen(
                rows, key_cache, value_cache, tables, cu, lens, scale, out=out
            )
        else:
            prefill.paged_attention_prefill_varlen(
                rows, key_cache, value_cache, tables, cu, lens, scale, out=out, tile=tile
            )

    if s.prefix:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(s.q_len, ctx)
        kwargs = {"attn_mask": mask}
    else:
        kwargs = {"is_causal": True}
    gqa = s.heads != s.kv_heads

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa, **kwargs)

    flop = causal_flop(s)
    ours()
    row = {**asdict(s), "tile": str(tile or prefill.TILES[s.head])}
    row["kernel_us"] = gpu_time_ms(ours, iters) * 1e3
    row["kernel_tflops"] = flop / row["kernel_us"] / 1e6
    try:
        want = sdpa()
        row["sdpa_us"] = gpu_time_ms(sdpa, iters) * 1e3
        row["sdpa_tflops"] = flop / row["sdpa_us"] / 1e6
        row["vs_sdpa"] = row["kernel_us"] / row["sdpa_us"]
        got = out.view(s.batch, s.q_len, s.heads, s.head).transpose(1, 2)
        row["rel_err_vs_sdpa"] = rel_err(got, want)
    except RuntimeError as e:  # flash SDPA refuses this shape or mask
        row["sdpa_error"] = str(e).splitlines()[0][:120]
    return row


def parse_tile(text: str):
    """``HEAD:WxMxN`` -> (head, Tile)."""
    from streamkv.kernels import prefill

    head, _, spec = text.partition(":")
    w, m, n = (int(x) for x in spec.split("x"))
    return int(head), prefill.Tile(w, m, n)


def run_kernels(args) -> list[dict]:
    from benchmarks.bench_kernels import print_table

    rows = [bench_kernel(s, args.iters) for s in SHAPES]
    by_head = {s.head: s for s in reversed(SHAPES) if s.block == 16}
    for text in filter(None, args.tiles.split(",")):
        head, tile = parse_tile(text)
        rows.append(bench_kernel(by_head[head], args.iters, tile))
    print(
        f"\nPrefill attention on {torch.cuda.get_device_name()} "
        "(bf16; us = median CUDA-graph replay)"
    )
    print_table(
        rows,
        [
            ("name", "shape", ""),
            ("tile", "tile", ""),
            ("kernel_us", "kernel us", ".1f"),
            ("sdpa_us", "sdpa us", ".1f"),
            ("vs_sdpa", "kernel/sdpa", ".3f"),
            ("kernel_tflops", "kernel TFLOP/s", ".0f"),
            ("sdpa_tflops", "sdpa TFLOP/s", ".0f"),
            ("rel_err_vs_sdpa", "rel err", ".1e"),
        ],
    )
    return rows


# ------------------------------------------------------------------------------ end to end
def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1000, vocab, (n, length), generator=gen).tolist()


def time_engine(llm, prompts: list[list[int]]) -> float:
    from streamkv import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == 1 for o in outs)
    return elapsed


@torch.inference_mode()
def time_transformers(hf, prompts: list[list[int]], batch_tokens: int) -> float:
    batch = max(1, batch_tokens // len(prompts[0]))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[i : i + batch], device="cuda")
        hf(input_ids=ids, use_cache=False, logits_to_keep=1)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def run_e2e(args) -> list[dict]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from streamkv.entrypoints.llm import LLM

    workloads = [tuple(int(x) for x in w.split("x")) for w in args.workloads.split(",")]
    longest = max(length for _, length in workloads)
    llm = LLM(
        args.model,
        load_format="dummy",
        dtype="bfloat16",
        max_num_seqs=max(n for n, _ in workloads),
        max_model_len=longest + 16,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=False,  # random prompts; the warm-up must not seed hits
    )
    config = AutoConfig.from_pretrained(str(llm.engine.executor.model_dir))
    with torch.device("cuda"):  # random weights, made in bf16 on the device
        hf = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    hf.eval()
    params = sum(p.numel() for p in hf.parameters())
    rows = []
    for n, length in workloads:
        prompts = random_prompts(n, length, config.vocab_size, seed=n * length)
        warm = random_prompts(max(1, n // 8), length, config.vocab_size, seed=1 + n * length)
        time_engine(llm, warm)
        time_transformers(hf, warm, args.hf_batch_tokens)
        tokens = n * length
        roofline_s = 2 * params * tokens / (args.peak_tflops * 1e12)
        for system, fn in (
            ("streamkv", lambda p=prompts: time_engine(llm, p)),
            ("transformers", lambda p=prompts: time_transformers(hf, p, args.hf_batch_tokens)),
        ):
            best = min(fn() for _ in range(args.rounds))
            rows.append(
                {
                    "workload": f"{n} x {length}",
                    "system": system,
                    "seconds": best,
                    "prompt_tok_s": tokens / best,
                    "roofline_fraction": roofline_s / best,
                }
            )
        rows[-2]["vs_transformers"] = rows[-2]["prompt_tok_s"] / rows[-1]["prompt_tok_s"]
        print(
            f"{n} x {length}: streamkv {rows[-2]['prompt_tok_s']:.0f} tok/s, "
            f"transformers {rows[-1]['prompt_tok_s']:.0f} "
            f"tok/s ({rows[-2]['vs_transformers']:.2f}x)",
            flush=True,
        )
    from benchmarks.bench_kernels import print_table

    print(
        f"\nEnd-to-end prefill, {args.model} dummy bf16, "
        f"max_tokens=1, {params / 1e9:.2f}e9 params, "
        f"roofline at {args.peak_tflops:.0f} TFLOP/s; best of {args.rounds}"
    )
    print_table(
        rows,
        [
            ("workload", "workload", ""),
            ("system", "system", ""),
            ("seconds", "seconds", ".2f"),
            ("prompt_tok_s", "prompt tok/s", ".0f"),
            ("roofline_fraction", "of roofline", ".2f"),
            ("vs_transformers", "vs transformers", ".2f"),
        ],
    )
    llm.shutdown()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    part = ap.add_mutually_exclusive_group()
    part.add_argument(
        "--kernel-only", action="store_true", help="only (a), the kernel against SDPA"
    )
    part.add_argument(
        "--e2e-only", action="store_true", help="only (b), the engine against transformers"
    )
    ap.add_argument("--iters", type=int, default=20, help="(a) timed graph replays per row")
    ap.add_argument(
        "--tiles",
        default="128:8x1x64,128:4x2x32,64:4x2x128,256:4x1x64",
        help="(a) extra tiles, each timed on the 4k shape of its head size: "
        "HEAD:warps x m16 tiles per warp x keys",
    )
    ap.add_argument("--model", default="llama3-8b", help="(b) preset or model dir (dummy weights)")
    ap.add_argument(
        "--workloads", default="64x4000,256x500", help="(b) prompts x tokens, comma list"
    )
    ap.add_argument("--rounds", type=int, default=2, help="(b) timed runs per system (best kept)")
    ap.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="(b) engine step budget"
    )
    ap.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.55,
        help="(b) the engine's share, leaving room for the transformers model",
    )
    ap.add_argument(
        "--hf-batch-tokens",
        type=int,
        default=64000,
        help="(b) prompt tokens per transformers forward",
    )
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="(b) bf16 matmul roofline")
    ap.add_argument("--out", default="bench_results/prefill.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_prefill.py needs a CUDA GPU", file=sys.stderr)
        return 2
    result: dict = {"gpu": torch.cuda.get_device_name(), "args": vars(args)}
    if not args.e2e_only:
        result["kernel"] = run_kernels(args)
    if not args.kernel_only:
        result["e2e"] = run_e2e(args)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2, default=str)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
