"""Structured-output overhead: output tokens per second of a batch of json_schema requests
against the same batch unconstrained, in one run on one engine.

Each round decodes --num-requests prompts with a JSON schema each (four schemas in turn:
required fields, enums, an array, a nested object; greedy), then the same prompts with no
constraint, each request held to exactly the number of tokens its structured twin produced
(EOS ignored). Both halves therefore run the same batch shapes step for step, and the ratio
is the cost of the grammar alone: compile (cached after the warm-up), the host's matcher
work and masks, and the masked sampler. (With async scheduling a structured step overlaps
the next one as a plain step does; its masks follow it: engine/step_pipeline.py.) Rounds
alternate which half runs first (ABBA), so a machine whose speed drifts favours neither; the
median is kept. ``--phases`` then runs each half once more with the step's phases clocked
(benchmarks/step_phases.py: schedule, build, submit, wait, process, accept, mask fills,
attach, sampler, mask step; ``--sync-debug`` adds torch's count of host-device syncs), apart
from the timed rounds, whose time the clock's wrappers would inflate. Prints a table and
writes JSON, including how many structured outputs parsed and validated.

    python benchmarks/bench_structured.py --device cpu --num-requests 64 --output-len 64
    # --async-scheduling is off by default on a CPU:
    python benchmarks/bench_structured.py --device cpu --async-scheduling ...
    python benchmarks/bench_structured.py --load-format dummy --device cuda --dtype bfloat16

    python benchmarks/bench_structured.py --model bench_inputs/smollm2-tokenizer --shape llama3-8b \
        --load-format dummy --device cuda --dtype bfloat16

The third line is the GPU run: the embedded model's config and tokenizer (SmolLM2-135M,
49,152 tokens) with random weights, so it needs no download. ``--shape PRESET`` (the last
line) runs a served size: a temporary model directory with the preset's dimensions
(streamkv/models/presets/PRESET/config.json) and --model's vocabulary, special token ids and
tokenizer files, so the grammar engine sees the tokenizer the model emits (dummy weights
only). On an H200 a llama3-8b step takes ~5 ms of GPU time, which the host's structured work
can hide behind; SmolLM2-135M's ~1.4 ms cannot.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "ok": {"type": "boolean"},
            "note": {"type": "string", "maxLength": 40},
        },
        "required": ["color", "ok", "note"],
    },
    {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "minItems": 1,
                "maxItems": 4,
            }
        },
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "email": {"type": "string", "maxLength": 32},
                },
                "required": ["id", "email"],
            },
            "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 4},
        },
        "required": ["user", "scores"],
    },
]


# What a --shape model takes from --model: the vocabulary and the token ids that index it.
TOKEN_KEYS = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def shaped_model_dir(preset: str, tokenizer_dir: str | os.PathLike, out: str | os.PathLike) -> Path:
    """``out``: a model directory with ``preset``'s dimensions and ``tokenizer_dir``'s
    vocabulary, special token ids and tokenizer files (no weights: --load-format dummy)."""
    from streamkv.models.loader import PRESETS_DIR, presets

    if preset not in presets():
        raise SystemExit(f"--shape: no preset {preset!r}; the presets are {presets()}")
    src = Path(tokenizer_dir)
    if not (src / "config.json").is_file() or not (src / "tokenizer.json").is_file():
        raise SystemExit(
            f"--shape needs --model to be a directory with config.json and tokenizer.json: {src}"
        )
    config = json.loads((PRESETS_DIR / preset / "config.json").read_text())
    config.pop("_source", None)
    tokens = json.loads((src / "config.json").read_text())
    for key in TOKEN_KEYS:
        config.pop(key, None)
        if key in tokens:
            config[key] = tokens[key]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


def structured_params(num: int, output_len: int) -> list:
    from streamkv import SamplingParams

    return [
        SamplingParams(
            temperature=0.0,
            max_tokens=output_len,
            structured_outputs={"json": SCHEMAS[i % len(SCHEMAS)]},
        )
        for i in range(num)
    ]


def plain_params(lengths: list[int]) -> list:
    from streamkv import SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]


def valid(text: str, schema: dict) -> bool:
    import jsonschema  # the dev extra

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):  # not JSON (cut by max_tokens), or off-schema
        return False
    return True


def run(llm, prompts: list[list[int]], params: list) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return time.perf_counter() - start, outs


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default=None, help="HF dir, .gguf or preset (default: the embedded model)"
    )
    ap.add_argument(
        "--shape",
        default=None,
        help="a preset's dimensions (llama3-8b, ...) with --model's "
        "vocabulary and tokenizer; needs --load-format dummy",
    )
    ap.add_argument(
        "--load-format", default="auto", help="'dummy': random weights of the model's shape"
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--num-requests", type=int, default=64, help="the batch: every request runs at once"
    )
    ap.add_argument(
        "--output-len", type=int, default=64, help="max_tokens of the structured requests"
    )
    ap.add_argument(
        "--rounds", type=int, default=3, help="timed rounds (structured, then plain; median kept)"
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--distributed-executor-backend", default=None, choices=["inprocess", "mp"])
    ap.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=(
            "schedule step N+1 while step N runs (default: "
            "the engine's: on for a GPU, off for a CPU)"
        ),
    )
    ap.add_argument(
        "--overlap-structured",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=(
            "let structured steps overlap the next one (their masks follow; default: the engine's)"
        ),
    )
    ap.add_argument(
        "--phases",
        action="store_true",
        help="after the timed rounds, one profiled run of each half",
    )
    ap.add_argument(
        "--sync-debug", action="store_true", help="with --phases on CUDA: count host-device syncs"
    )
    ap.add_argument("--json-out", default="bench_results/structured.json")
    args = ap.parse_args()
    if args.shape is not None:
        if args.load_format != "dummy" or args.model is None:
            raise SystemExit(
                "--shape takes --model TOKENIZER_DIR and "
                "--load-format dummy (the preset has no weights)"
            )
        with tempfile.TemporaryDirectory(prefix=f"streamkv-{args.shape}-") as tmp:
            return bench(args, str(shaped_model_dir(args.shape, args.model, tmp)))
    return bench(args, args.model)


def bench(args, model: str | None) -> int:
    import torch

    from streamkv.entrypoints.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.num_requests
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    llm = LLM(
        model,
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        max_num_seqs=max(n, 8),
        num_kv_blocks=n * (-(-(48 + args.output_len) // 16) + 1) + 16 if on_cpu else None,
        num_swap_blocks=0,
        distributed_executor_backend=args.distributed_executor_backend,
        **{
            k: v
            for k, v in (
                ("async_scheduling", args.async_scheduling),
                ("overlap_structured", args.overlap_structured),
            )
            if v is not None
        },
    )
    tok = llm.get_tokenizer()
    prompts = [
        tok.encode(f"Reply with one JSON object only. Record number {i} of the user table:")
        for i in range(n)
    ]

    # Warm-up: compiles every schema, and fixes each request's length (greedy: the same in
    # every round, but for bf16 near-ties, counted below), which the plain twins take.
    _, outs = run(llm, prompts, structured_params(n, args.output_len))
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    # Greedy: the same tokens whatever the step pipeline (in turn or overlapped), which two
    # runs of this script compare by this digest.
    digest = hashlib.sha256(
        json.dumps([o.outputs[0].token_ids for o in outs]).encode()
    ).hexdigest()[:16]
    tokens = sum(lengths)
    ok = sum(valid(o.outputs[0].text, SCHEMAS[i % len(SCHEMAS)]) for i, o in enumerate(outs))
    run(llm, prompts[:8], plain_params(lengths[:8]))
    times: dict[str, list[float]] = {"json_schema": [], "unconstrained": []}
    counts: dict[str, list[int]] = {mode: [] for mode in times}  # output tokens of each run
    overlapped = {
        mode: 0 for mode in times
    }  # steps whose successor was submitted before they were read
    engine = llm.engine
    for r in range(args.rounds):
        for mode in ("json_schema", "unconstrained")[:: 1 if r % 2 == 0 else -1]:
            params = (
                structured_params(n, args.output_len)
                if mode == "json_schema"
                else plain_params(lengths)
            )
            before = engine.overlapped_steps
            t, outs = run(llm, prompts, params)
            overlapped[mode] += engine.overlapped_steps - before
            times[mode].append(t)
            counts[mode].append(sum(len(o.outputs[0].token_ids) for o in outs))
            print(f"round {r}: {mode} {t:.3f}s, {counts[mode][-1]} tokens", flush=True)
    # A structured run may end some outputs elsewhere than the warm-up did: in bf16 a greedy
    # near-tie can flip with the batch's make-up (the H200 at 256 tokens). Each run's tok/s is
    # then of its own tokens, and the runs that differed are counted.
    changed = sum(c != tokens for c in counts["json_schema"])

    phases = profile(llm, prompts, args, lengths) if args.phases else {}

    rows = []
    for mode, ts in times.items():
        rates = [c / t for c, t in zip(counts[mode], ts, strict=True)]
        rows.append(
            {
                "mode": mode,
                "seconds": statistics.median(ts),
                "output_tokens": statistics.median(counts[mode]),
                "output_tok_s": statistics.median(rates),
            }
        )
    ratio = rows[0]["output_tok_s"] / rows[1]["output_tok_s"]
    ex = llm.engine.executor
    shape = args.shape or "the model's own"
    print(
        f"\nmodel {args.model or 'embedded'}, shape {shape} "
        f"({args.load_format}, {ex.dtype}, {ex.device}); batch {n}, "
        f"structured max_tokens {args.output_len}, median "
        f"of {args.rounds}; {ok}/{n} structured outputs "
        f"parse and validate (the rest hit max_tokens); outputs {digest}"
    )
    print(f"{'mode':<15}{'seconds':>10}{'tokens':>9}{'out tok/s':>12}")
    for r in rows:
        print(
            f"{r['mode']:<15}{r['seconds']:>10.3f}{r['output_tokens']:>9.0f}{r['output_tok_s']:>12.1f}"
        )
    print(f"json_schema / unconstrained: {ratio:.3f}x (median tok/s of each half)")
    if changed:
        print(f"{changed} of {args.rounds} json_schema runs made other lengths than the warm-up")
    if phases:
        g = phases["json_schema"]["grammar_s"]
        print(
            f"the grammar's host time (profiled run): {g:.3f}s "
            f"of {phases['json_schema']['seconds']:.3f}s"
        )
    print(
        f"async scheduling {'on' if engine.async_scheduling else 'off'}, overlap_structured "
        f"{'on' if engine.config.scheduler.overlap_structured else 'off'}; "
        "steps overlapped over the rounds: "
        + ", ".join(f"{mode} {k}" for mode, k in overlapped.items())
    )
    os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump(
            {
                "args": vars(args),
                "shape": shape,
                "device": str(ex.device),
                "dtype": str(ex.dtype),
                "times": times,
                "rows": rows,
                "ratio": ratio,
                "phases": phases,
                "async_scheduling": engine.async_scheduling,
                "overlap_structured": engine.config.scheduler.overlap_structured,
                "overlapped_steps": overlapped,
                "valid": ok,
                "lengths": lengths,
                "outputs_sha256": digest,
                "token_counts": counts,
                "json_schema_runs_changed": changed,
            },
            f,
            indent=2,
        )
    llm.shutdown()
    return 0


def profile(llm, prompts: list[list[int]], args, lengths: list[int]) -> dict:
    """One run of each half with the step's phases clocked (benchmarks/step_phases.py)."""
    from step_phases import PhaseClock, print_report

    out = {}
    engine = llm.engine
    for mode in ("json_schema", "unconstrained"):
        params = (
            structured_params(len(prompts), args.output_len)
            if mode == "json_schema"
            else plain_params(lengths)
        )
        before = engine.overlapped_steps
        with PhaseClock(sync_debug=args.sync_debug) as clock:
            t, _ = run(llm, prompts, params)
        steps = clock.calls["step"]
        overlapped = engine.overlapped_steps - before
        report = clock.report(steps)
        print_report(
            f"{mode} ({t:.3f}s, {overlapped} steps overlapped)", report, steps, clock.syncs
        )
        out[mode] = {
            "seconds": t,
            "steps": steps,
            "overlapped_steps": overlapped,
            "grammar_s": clock.grammar_seconds(),
            "phases": report,
            "syncs": dict(clock.syncs),
        }
    return out


if __name__ == "__main__":
    sys.exit(main())
