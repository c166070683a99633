"""xgrammar against llguidance: what a structured row costs per token on the host.

For each JSON schema, both engines compile it for the embedded model's tokenizer (SmolLM2,
49,152 tokens), then walk the tokens of a valid instance: per token, fill the next-token
bitmask (int32 words) and accept the token, which is what the engine does for a structured
row every step. Prints a table (compile ms, mask+accept us per token) and writes JSON.

    .venv/bin/python benchmarks/bench_grammar_engines.py --out /tmp/grammar_engines.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

SCHEMAS = {
    "person": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        },
        {"name": "Ada Lovelace", "age": 36},
    ),
    "enum+array": (
        {
            "type": "object",
            "properties": {
                "color": {"enum": ["red", "green", "blue"]},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            },
            "required": ["color", "tags"],
        },
        {"color": "green", "tags": ["alpha", "beta", "gamma"]},
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "order": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer"},
                        "items": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "sku": {"type": "string"},
                                    "qty": {"type": "integer"},
                                    "price": {"type": "number"},
                                },
                                "required": ["sku", "qty", "price"],
                            },
                        },
                    },
                    "required": ["id", "items"],
                },
                "note": {"type": "string"},
            },
            "required": ["order"],
        },
        {
            "order": {
                "id": 42,
                "items": [
                    {"sku": "A-1", "qty": 2, "price": 9.5},
                    {"sku": "B-22", "qty": 1, "price": 120.25},
                ],
            },
            "note": "leave at the door",
        },
    ),
    "json_object": (None, {"free": [1, 2, {"x": "y"}], "ok": True}),
}


def _walk_xgrammar(tok, eos: list[int], vocab: int, reps: int) -> dict:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    out = {}
    for name, (schema, instance) in SCHEMAS.items():
        t0 = time.perf_counter()
        g = (
            compiler.compile_builtin_json_grammar()
            if schema is None
            else compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        )
        compile_ms = (time.perf_counter() - t0) * 1e3
        ids = tok.encode(json.dumps(instance), add_special_tokens=False) + eos[:1]
        mask = xgr.allocate_token_bitmask(1, vocab)
        times = []
        for _ in range(reps):
            m = xgr.GrammarMatcher(g)
            t0 = time.perf_counter()
            for t in ids:
                m.fill_next_token_bitmask(mask)
                if not m.accept_token(t):
                    raise RuntimeError(f"xgrammar refused token {t} of {name}")
            times.append((time.perf_counter() - t0) / len(ids))
        out[name] = {"compile_ms": compile_ms, "us_per_token": min(times) * 1e6, "tokens": len(ids)}
    return out


def _walk_llguidance(tok, eos: list[int], vocab: int, reps: int) -> dict:
    import llguidance as llg
    import llguidance.hf
    import llguidance.numpy as lln

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos[0])
    out = {}
    for name, (schema, instance) in SCHEMAS.items():
        t0 = time.perf_counter()
        spec = {"type": "object"} if schema is None else schema
        grammar = llg.LLMatcher.grammar_from_json_schema(
            spec,
            defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
        )
        err = llg.LLMatcher.validate_grammar(grammar, lltok)
        if err:
            raise RuntimeError(err)
        compile_ms = (time.perf_counter() - t0) * 1e3
        ids = tok.encode(json.dumps(instance), add_special_tokens=False) + eos[:1]
        mask = lln.allocate_token_bitmask(1, vocab)
        times = []
        for _ in range(reps):
            m = llg.LLMatcher(lltok, grammar)
            t0 = time.perf_counter()
            for t in ids:
                lln.fill_next_token_bitmask(m, mask, 0)
                if not m.consume_token(t):
                    raise RuntimeError(f"llguidance refused token {t} of {name}: {m.get_error()}")
            times.append((time.perf_counter() - t0) / len(ids))
        out[name] = {"compile_ms": compile_ms, "us_per_token": min(times) * 1e6, "tokens": len(ids)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="walks per schema (the fastest is kept)")
    ap.add_argument("--out", default="grammar_engines.json", help="JSON results")
    args = ap.parse_args()
    from streamkv.models.loader import load_tokenizer, resolve_model_dir

    tok = load_tokenizer(resolve_model_dir(None))
    vocab = len(tok)
    eos = [tok.eos_token_id]
    res = {
        "vocab": vocab,
        "xgrammar": _walk_xgrammar(tok, eos, vocab, args.reps),
        "llguidance": _walk_llguidance(tok, eos, vocab, args.reps),
    }
    print(
        f"{'schema':<12} {'engine':<11} {'compile ms':>10} {'mask+accept us/tok':>19} {'tokens':>6}"
    )
    for name in SCHEMAS:
        for eng in ("xgrammar", "llguidance"):
            r = res[eng][name]
            print(
                f"{name:<12} {eng:<11} {r['compile_ms']:>10.1f} "
                f"{r['us_per_token']:>19.1f} {r['tokens']:>6}"
            )
    for eng in ("xgrammar", "llguidance"):
        res[eng + "_mean_us"] = float(np.mean([r["us_per_token"] for r in res[eng].values()]))
        print(f"mean {eng}: {res[eng + '_mean_us']:.1f} us/token")
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
