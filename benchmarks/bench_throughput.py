"""Offline throughput: streamkv vs transformers' generate with request-level static batching
(the paper's FasterTransformer-style baseline: a batch waits for its longest request), on the
same ShareGPT requests in the same run. Prints a table and writes JSON.

    python benchmarks/bench_throughput.py --num-requests 48 --json-out bench_results/throughput.json

With --compare-executors it compares executors instead: the same requests on the in-process
executor (TP 1) and on the multiprocess one at --tensor-parallel-size (alternating rounds),
with the mp executor's per-step IPC overhead (its execute() round trip minus rank 0's time
in Worker.execute) and whether the greedy outputs are identical.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_streamkv(llm, requests, keep: list | None = None) -> float:
    from streamkv import SamplingParams

    params = [
        SamplingParams(temperature=0, ignore_eos=True, max_tokens=r.output_len) for r in requests
    ]
    llm.reset_prefix_cache()  # every run cold: no prompt hits the blocks of an earlier one
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=[r.prompt_ids for r in requests], sampling_params=params)
    elapsed = time.perf_counter() - start
    for r, o in zip(requests, outs):
        assert len(o.outputs[0].token_ids) == r.output_len
    if keep is not None:
        keep.extend(list(o.outputs[0].token_ids) for o in outs)
    return elapsed


def compare_executors(args, kwargs: dict, requests, out_tokens: int, on_cpu: bool) -> dict:
    """In-process TP 1 vs mp at args.tensor_parallel_size, best of args.rounds each. On the
    CPU both engines stay up and the rounds alternate, so that drift in the machine's speed
    hits both alike; on a GPU each would claim the memory, so they run one after the other."""
    import gc
    import statistics

    from streamkv.entrypoints.llm import LLM

    setups = (("inprocess", 1), ("mp", args.tensor_parallel_size))
    times: dict[str, list[float]] = {b: [] for b, _ in setups}
    steps: dict[str, list[int]] = {b: [] for b, _ in setups}
    outputs: dict[str, list] = {b: [] for b, _ in setups}
    ipc: dict = {}

    def build(backend: str, tp: int):
        llm = LLM(
            args.model, **kwargs, tensor_parallel_size=tp, distributed_executor_backend=backend
        )
        run_streamkv(llm, requests[:4])  # warm-up
        return llm

    def timed(backend: str, llm) -> None:
        before = llm.engine.stats_.steps
        times[backend].append(
            run_streamkv(llm, requests, outputs[backend] if not outputs[backend] else None)
        )
        steps[backend].append(llm.engine.stats_.steps - before)
        print(f"{backend}: {times[backend][-1]:.2f}s", flush=True)

    def close(backend: str, llm) -> None:
        if backend == "mp":
            ipc.update(llm.engine.executor.ipc_stats())
        llm.shutdown()

    if on_cpu:
        llms = {b: build(b, tp) for b, tp in setups}
        for _ in range(args.rounds):
            for b, _tp in setups:
                timed(b, llms[b])
        for b, llm in llms.items():
            close(b, llm)
    else:
        import torch

        for b, tp in setups:
            llm = build(b, tp)
            for _ in range(args.rounds):
                timed(b, llm)
            close(b, llm)
            del llm  # an in-process model's memory must be free before the ranks size their pools
            gc.collect()
            torch.cuda.empty_cache()
    rows = []
    for b, tp in setups:
        med = statistics.median(times[b])
        n_steps = steps[b][0]
        row = {
            "executor": b,
            "tp": tp,
            "seconds": med,
            "steps": n_steps,
            "step_ms": 1e3 * med / n_steps,
            "output_tok_s": out_tokens / med,
            "all_seconds": times[b],
        }
        if b == "mp":
            row["ipc"] = ipc
        rows.append(row)
    pairs = list(zip(outputs["inprocess"], outputs["mp"]))
    same = sum(x == y for x, y in pairs)
    # Where outputs diverge (e.g. bfloat16 sums in another order), how far they agreed first.
    prefix = sum(
        next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in pairs
    )
    return {
        "rows": rows,
        "identical_outputs": same,
        "compared_outputs": len(requests),
        "agreeing_prefix_fraction": prefix / max(sum(len(x) for x, _ in pairs), 1),
        "ratio_mp_vs_inprocess": rows[1]["output_tok_s"] / rows[0]["output_tok_s"],
    }


def print_comparison(result: dict) -> None:
    print(
        f"{'executor':<12}{'TP':>4}{'median s':>10}{'steps':>8}"
        f"{'ms/step':>10}{'out tok/s':>12}{'IPC ms/step':>14}"
    )
    for r in result["rows"]:
        ipc = f"{r['ipc']['overhead_ms']:.3f}" if "ipc" in r else "-"
        print(
            f"{r['executor']:<12}{r['tp']:>4}{r['seconds']:>10.2f}{r['steps']:>8}{r['step_ms']:>10.2f}"
            f"{r['output_tok_s']:>12.1f}{ipc:>14}"
        )
    print(
        "mp / inprocess throughput = "
        f"{result['ratio_mp_vs_inprocess']:.3f}x; greedy outputs identical: "
        f"{result['identical_outputs']}/{result['compared_outputs']} (tokens before the first "
        f"divergence: {100 * result['agreeing_prefix_fraction']:.1f}%)"
    )


def print_rows(rows: list[dict], ratio: float | None) -> None:
    print(f"{'system':<22}{'batch':<22}{'seconds':>10}{'out tok/s':>12}")
    for r in rows:
        print(f"{r['system']:<22}{r['batch']:<22}{r['seconds']:>10.1f}{r['output_tok_s']:>12.1f}")
    if ratio is not None:  # static baselines were run
        print(f"streamkv / best static baseline = {ratio:.2f}x")


def run_static_batching(model, requests, batch_size: int, pad_id: int) -> float:
    """transformers generate, FCFS batches of ``batch_size``, left-padded; each batch runs
    until its longest requested output (EOS suppressed, as with ignore_eos)."""
    import torch

    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        width = max(len(r.prompt_ids) for r in batch)
        device = model.device
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, r in enumerate(batch):
            ids[j, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[j, width - len(r.prompt_ids) :] = 1
        longest = max(r.output_len for r in batch)
        with torch.inference_mode():
            model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                do_sample=False,
                max_new_tokens=longest,
                min_new_tokens=longest,
                pad_token_id=pad_id,
            )
    return time.perf_counter() - start


def run_transformers_cb(model, requests) -> tuple[float, int]:
    """transformers' own continuous batching (``generate_batch``, paged|sdpa attention, CUDA
    graphs where the installed version offers them), greedy; returns (seconds, tokens made).
    Tokens are counted from its outputs, since EOS cannot be suppressed the same way there."""
    from transformers import GenerationConfig

    out_len = max(r.output_len for r in requests)
    gen = GenerationConfig(
        max_new_tokens=out_len, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    kwargs = {}
    try:  # transformers >= 5.2x keeps the CB knobs in their own record
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(use_cuda_graph=True)
    except (ImportError, TypeError):
        gen.use_cuda_graph = True
    prompts = [r.prompt_ids for r in requests]
    model.generate_batch(
        inputs=prompts[:4], generation_config=gen, **kwargs
    )  # warm-up, graph capture
    start = time.perf_counter()
    outs = model.generate_batch(inputs=prompts, generation_config=gen, **kwargs)
    elapsed = time.perf_counter() - start
    made = sum(len(o.generated_tokens) for o in outs.values())
    return elapsed, made


def build_transformers(model_dir: str, load_format: str, device, dtype):
    """transformers' copy of the model; with dummy weights the same shape, random values,
    built on the device (throughput does not depend on the values)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if load_format == "dummy":
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument(
        "--max-output-len", type=int, default=256, help="cap on a request's output length"
    )
    ap.add_argument("--max-prompt-len", type=int, default=512)
    ap.add_argument(
        "--baseline-batch-sizes", default="8,16", help="comma list; the best is the baseline"
    )
    ap.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="default: the engine's (256, or 1024 on a big GPU)",
    )
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the engine's step token budget (default: the engine's)",
    )
    ap.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="overlap the next step's scheduling with this one's device work "
        "(default: the engine's, on on a GPU and off on a CPU)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument(
        "--model", default=None, help="HF dir, .gguf or preset (default: embedded SmolLM2)"
    )
    ap.add_argument(
        "--load-format", default="auto", help="'dummy' for random weights of a real shape"
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="default: 4096 on CPU, sized from memory on GPU",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "fp8", "fp8_e4m3"),
        help="KV cache element type (docs/kernels.md, 'FP8 KV cache')",
    )
    ap.add_argument(
        "--quantization",
        default=None,
        choices=("fp8",),
        help="fp8 weights (docs/kernels.md, 'FP8 weights'); default: the model's dtype",
    )
    ap.add_argument(
        "--workload-file",
        default=None,
        help="JSON of [[prompt ids], output len] pairs; written with --save-workload",
    )
    ap.add_argument(
        "--save-workload", default=None, help="sample the ShareGPT workload, save it here, exit"
    )
    ap.add_argument(
        "--random-input-len",
        type=int,
        default=None,
        help="instead of ShareGPT: random token-id prompts of this length, each with "
        "--max-output-len output tokens (no tokenizer or data set needed, e.g. for a preset)",
    )
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument(
        "--distributed-executor-backend",
        default=None,
        choices=["inprocess", "mp"],
        help="default: inprocess at TP 1, mp above",
    )
    ap.add_argument(
        "--compare-executors",
        action="store_true",
        help=(
            "instead of the transformers baselines: in-process TP 1 vs mp at --tensor-parallel-size"
        ),
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="--compare-executors: timed runs per executor (median kept)",
    )
    ap.add_argument(
        "--cb-requests",
        type=int,
        default=0,
        help="also run transformers' generate_batch (paged|sdpa, continuous batching) and "
        "streamkv on the first N requests, each --cb-output-len tokens, same run",
    )
    ap.add_argument("--cb-output-len", type=int, default=256)
    ap.add_argument(
        "--phases",
        action="store_true",
        help="run the requests once more with the step phases' host timers on "
        "(benchmarks/step_phases.py; 'wait' is the host blocked on the device) and print them",
    )
    ap.add_argument("--json-out", default="bench_results/throughput.json")
    args = ap.parse_args()

    import torch

    from benchmarks.workloads import Request, sharegpt_requests
    from streamkv.entrypoints.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.save_workload:
        from transformers import AutoTokenizer

        from streamkv.models.loader import resolve_model_dir

        tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))
        reqs = sharegpt_requests(
            tok,
            args.num_requests,
            args.seed,
            max_prompt=args.max_prompt_len,
            max_output=args.max_output_len,
        )
        with open(args.save_workload, "w") as f:
            json.dump([[r.prompt_ids, r.output_len] for r in reqs], f)
        print(f"saved {len(reqs)} requests to {args.save_workload}")
        return 0
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    blocks = args.num_kv_blocks or (4096 if on_cpu else None)
    kwargs = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "num_kv_blocks": blocks,
        "num_swap_blocks": 0,
        "kv_cache_dtype": args.kv_cache_dtype,
        "quantization": args.quantization,
        "device": args.device,
        "dtype": args.dtype,
        "load_format": args.load_format,
        "async_scheduling": args.async_scheduling,
    }
    if args.workload_file:
        with open(args.workload_file) as f:
            requests = [Request(p, min(o, args.max_output_len)) for p, o in json.load(f)][
                : args.num_requests
            ]
    elif args.random_input_len:
        import random

        from streamkv.models.loader import load_config, resolve_model_dir

        vocab = load_config(resolve_model_dir(args.model))["vocab_size"]
        rng = random.Random(args.seed)
        requests = [
            Request(
                [rng.randrange(1000, vocab) for _ in range(args.random_input_len)],
                args.max_output_len,
            )
            for _ in range(args.num_requests)
        ]
    else:
        from streamkv.models.loader import load_tokenizer, resolve_model_dir

        tok = load_tokenizer(resolve_model_dir(args.model))
        requests = sharegpt_requests(
            tok,
            args.num_requests,
            args.seed,
            max_prompt=args.max_prompt_len,
            max_output=args.max_output_len,
        )
    out_tokens = sum(r.output_len for r in requests)
    in_tokens = sum(len(r.prompt_ids) for r in requests)
    if args.compare_executors:
        result = compare_executors(args, kwargs, requests, out_tokens, on_cpu)
        print(
            f"\nmodel {args.model or 'SmolLM2-135M'} ({args.load_format}, "
            f"{args.dtype}); {len(requests)} requests: "
            f"{in_tokens} prompt tokens, {out_tokens} output "
            f"tokens, torch threads {torch.get_num_threads()}"
        )
        print_comparison(result)
        result.update(
            {
                "args": vars(args),
                "num_requests": len(requests),
                "prompt_tokens": in_tokens,
                "output_tokens": out_tokens,
            }
        )
        os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
        return 0
    llm = LLM(
        args.model,
        **kwargs,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
    )
    from streamkv.worker.worker import resolve_dtype

    device = torch.device(llm.engine.config.model.device)  # resolved by the engine
    dtype = resolve_dtype(llm.engine.config.model.dtype, device)
    baselines = [int(x) for x in args.baseline_batch_sizes.split(",") if x]
    pad_id = 0

    run_streamkv(llm, requests[:4])  # warm-up
    rows = []
    t = run_streamkv(llm, requests)
    rows.append(
        {
            "system": "streamkv",
            "batch": f"continuous (<= {llm.engine.config.scheduler.max_num_seqs})",
            "seconds": t,
            "output_tok_s": out_tokens / t,
        }
    )
    print(f"streamkv: {t:.1f}s, {out_tokens / t:.1f} output tok/s", flush=True)
    phases = None
    if args.phases:
        from benchmarks.step_phases import PhaseClock, print_report

        with PhaseClock() as clock:
            t_p = run_streamkv(llm, requests)
        steps = clock.calls["step"]
        phases = {
            "seconds": t_p,
            "steps": steps,
            "report": clock.report(steps),
            "timeline": clock.timeline_report(),
        }
        print_report(
            f"streamkv with phase timers ({t_p:.1f}s)",
            phases["report"],
            steps,
            timeline=phases["timeline"],
        )
    if args.cb_requests:
        from benchmarks.workloads import Request as _Req

        cb_reqs = [_Req(r.prompt_ids, args.cb_output_len) for r in requests[: args.cb_requests]]
        cb_tokens = sum(r.output_len for r in cb_reqs)
        t_s = run_streamkv(llm, cb_reqs)
        rows.append(
            {
                "system": "streamkv (cb set)",
                "batch": f"{len(cb_reqs)} x {args.cb_output_len}",
                "seconds": t_s,
                "output_tok_s": cb_tokens / t_s,
            }
        )
    # The engine's facts for the report, then its memory back before transformers' copy
    # of the model is built: with the engine's graphs and pool still held, generate_batch's
    # own cache ran out of memory on the H200 and failed requests (2026-12-04).
    model_dir = str(llm.engine.model_info.model_dir)
    engine = {
        "stats": llm.stats(),
        "executor": llm.engine.config.model.executor_backend,
        "async_scheduling": llm.engine.async_scheduling,
        "max_num_batched_tokens": llm.engine.config.scheduler.max_num_batched_tokens,
        "max_num_seqs": llm.engine.config.scheduler.max_num_seqs,
    }
    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    hf, cb_ratio = None, None
    if args.cb_requests or baselines:  # transformers' copy of the model, only when compared
        hf = build_transformers(model_dir, args.load_format, device, dtype)
    if args.cb_requests:
        try:  # older transformers need the paged| prefix for generate_batch; newer warn about it
            hf.set_attn_implementation("paged|sdpa")
        except (ValueError, ImportError) as e:
            print(f"paged|sdpa not set ({e}); generate_batch picks its own paged attention")
        t_h, made = run_transformers_cb(hf, cb_reqs)
        hf.set_attn_implementation("sdpa")
        rows.append(
            {
                "system": "transformers generate_batch",
                "batch": f"{len(cb_reqs)} x {args.cb_output_len}",
                "seconds": t_h,
                "output_tok_s": made / t_h,
                "tokens": made,
            }
        )
        # Failed or cut-short requests (fewer tokens than asked) leave no fair ratio.
        cb_ratio = cb_tokens / t_s / (made / t_h) if made == cb_tokens else None
        print(
            f"cb set: streamkv {cb_tokens / t_s:.1f} tok/s, "
            f"transformers generate_batch {made / t_h:.1f} tok/s "
            f"({made} of {cb_tokens} tokens) -> "
            + (f"{cb_ratio:.2f}x" if cb_ratio else "no ratio: generate_batch fell short"),
            flush=True,
        )
    for bs in baselines:
        t = run_static_batching(hf, requests, bs, pad_id)
        rows.append(
            {
                "system": "transformers static",
                "batch": str(bs),
                "seconds": t,
                "output_tok_s": out_tokens / t,
            }
        )
        print(
            f"transformers static batch {bs}: {t:.1f}s, {out_tokens / t:.1f} output tok/s",
            flush=True,
        )
    static = [r["output_tok_s"] for r in rows if r["system"] == "transformers static"]
    ratio = rows[0]["output_tok_s"] / max(static) if static else None

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    print(
        f"\nmodel {args.model or 'SmolLM2-135M'} "
        f"({args.load_format}, {dtype}, {device}); "
        f"{engine['stats']['num_kv_blocks']} KV blocks; TP {args.tensor_parallel_size}, "
        f"{engine['executor']} executor"
    )
    print(
        f"{len(requests)} ShareGPT requests: {in_tokens} prompt tokens, {out_tokens} output tokens "
        f"(output cap {args.max_output_len}), torch threads {torch.get_num_threads()}"
    )
    print_rows(rows, ratio)
    result = {
        "args": vars(args),
        "num_requests": len(requests),
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "rows": rows,
        "ratio_vs_best_baseline": ratio,
        "ratio_vs_transformers_cb": cb_ratio,
        "stats": engine["stats"],
        # the settings the engine resolved (the defaults depend on the device)
        "async_scheduling": engine["async_scheduling"],
        "max_num_batched_tokens": engine["max_num_batched_tokens"],
        "max_num_seqs": engine["max_num_seqs"],
        "phases": phases,
    }
    os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
