"""Structured-output overhead: output tokens per second of a batch of json_schema requests
against the same batch unconstrained, in one run on one engine.

Each round decodes --num-requests prompts with a JSON schema each (four schemas in turn:
required fields, enums, an array, a nested object; greedy), then the same prompts with no
constraint, each request held to exactly the number of tokens its structured twin produced
(EOS ignored). Both halves therefore run the same batch shapes step for step, and the ratio
is the cost of the grammar alone: compile (cached after the warm-up), the host's matcher
work and masks, the masked sampler, and (with async scheduling) the synchronous steps that
structured rows need. Rounds alternate the two halves; the median is kept. Prints a table
and writes JSON, including how many structured outputs parsed and validated.

    python benchmarks/bench_structured.py --device cpu --num-requests 64 --output-len 64
    python benchmarks/bench_structured.py --load-format dummy --device cuda --dtype bfloat16

The second line is the GPU run: the embedded model's config and tokenizer (SmolLM2-135M,
49,152 tokens) with random weights, so it needs no download.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                                      "note": {"type": "string", "maxLength": 40}}, "required": ["color", "ok", "note"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                               "minItems": 1, "maxItems": 4}}, "required": ["tags"]},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"}, "email": {"type": "string", "maxLength": 32}},
                 "required": ["id", "email"]},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 4}}, "required": ["user", "scores"]},
]


def structured_params(num: int, output_len: int) -> list:
    from streamkv import SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=output_len, structured_outputs={"json": SCHEMAS[i % len(SCHEMAS)]})
            for i in range(num)]


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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF dir, .gguf or preset (default: the embedded model)")
    ap.add_argument("--load-format", default="auto", help="'dummy': random weights of the model's shape")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=64, help="the batch: every request runs at once")
    ap.add_argument("--output-len", type=int, default=64, help="max_tokens of the structured requests")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (structured, then plain; median kept)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--distributed-executor-backend", default=None, choices=["inprocess", "mp"])
    ap.add_argument("--json-out", default="bench_results/structured.json")
    args = ap.parse_args()

    import torch

    from streamkv.entrypoints.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.num_requests
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    llm = LLM(args.model, device=args.device, dtype=args.dtype, load_format=args.load_format, max_num_seqs=max(n, 8),
              num_kv_blocks=n * (-(-(48 + args.output_len) // 16) + 1) + 16 if on_cpu else None, num_swap_blocks=0,
              distributed_executor_backend=args.distributed_executor_backend)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(f"Reply with one JSON object only. Record number {i} of the user table:") for i in range(n)]

    _, warm = run(llm, prompts[:8], structured_params(8, 8))  # compiles every schema once
    run(llm, prompts[:8], plain_params([len(o.outputs[0].token_ids) for o in warm]))
    times: dict[str, list[float]] = {"json_schema": [], "unconstrained": []}
    tokens, ok = 0, 0
    for r in range(args.rounds):
        t, outs = run(llm, prompts, structured_params(n, args.output_len))
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        times["json_schema"].append(t)
        t_plain, plain = run(llm, prompts, plain_params(lengths))
        times["unconstrained"].append(t_plain)
        assert [len(o.outputs[0].token_ids) for o in plain] == lengths
        tokens = sum(lengths)
        ok = sum(valid(o.outputs[0].text, SCHEMAS[i % len(SCHEMAS)]) for i, o in enumerate(outs))
        print(f"round {r}: json_schema {t:.2f}s, unconstrained {t_plain:.2f}s, {tokens} tokens", flush=True)

    rows = []
    for mode, ts in times.items():
        t = statistics.median(ts)
        rows.append({"mode": mode, "seconds": t, "output_tokens": tokens, "output_tok_s": tokens / t})
    ratio = rows[0]["output_tok_s"] / rows[1]["output_tok_s"]
    ex = llm.engine.executor
    print(f"\nmodel {args.model or 'embedded'} ({args.load_format}, {ex.dtype}, {ex.device}); batch {n}, "
          f"structured max_tokens {args.output_len}, median of {args.rounds}; {ok}/{n} structured outputs "
          "parse and validate (the last round)")
    print(f"{'mode':<15}{'seconds':>10}{'tokens':>9}{'out tok/s':>12}")
    for r in rows:
        print(f"{r['mode']:<15}{r['seconds']:>10.2f}{r['output_tokens']:>9}{r['output_tok_s']:>12.1f}")
    print(f"json_schema / unconstrained: {ratio:.3f}x")
    os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump({"args": vars(args), "device": str(ex.device), "dtype": str(ex.dtype), "times": times,
                   "rows": rows, "ratio": ratio, "valid": ok, "lengths_last_round": lengths}, f, indent=2)
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
