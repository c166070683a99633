"""The engine's own CPU time per step, without a model: scheduling, block tables, StepInput,
output processing, detokenization, stats. A stand-in executor answers every sample at once
with a random token, so the figure is what a GPU step pays on top of the model.

    python benchmarks/bench_engine_overhead.py --num-seqs 256 --output-len 256

Prints ms per step and the top of a cProfile listing (--profile), writes JSON with --out.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from streamkv import SamplingParams  # noqa: E402
from streamkv.engine.llm_engine import LLMEngine  # noqa: E402
from streamkv.entrypoints.llm import engine_config  # noqa: E402
from streamkv.executor.base import Executor  # noqa: E402
from streamkv.messages import SampleResult, StepInput, StepOutput  # noqa: E402
from streamkv.models.loader import load_config, resolve_model_dir  # noqa: E402


class InstantExecutor(Executor):
    """The embedded model's tokenizer and config, no model: every sample is a random token."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        self.model_dir = resolve_model_dir(None)
        self.hf_config = load_config(self.model_dir)
        self.num_blocks = num_blocks
        self.rng = random.Random(seed)

    def num_available_blocks(self) -> tuple[int, int]:
        return self.num_blocks, 0

    def init_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        pass

    def execute(self, step: StepInput) -> StepOutput:
        draw = self.rng.randrange
        return StepOutput(
            {s.seq_id: SampleResult([draw(1000, 20000)], [-1.0]) for s in step.seqs if s.sample}
        )


def run(args) -> dict:
    blocks = args.num_seqs * -(-(args.max_prompt_len + args.output_len) // 16) + 16
    cfg = engine_config(None, device="cpu", max_num_seqs=args.num_seqs, num_kv_blocks=blocks,
                        num_swap_blocks=0, enable_prefix_caching=False)
    engine = LLMEngine(cfg, InstantExecutor(blocks, args.seed))
    rng = random.Random(args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.num_seqs):
        ids = [rng.randrange(1000, 20000) for _ in range(rng.randrange(args.max_prompt_len // 8, args.max_prompt_len))]
        engine.add_request(str(i), None, params, prompt_token_ids=ids)
    prof = cProfile.Profile() if args.profile else None
    steps, t = 0, time.perf_counter()
    if prof:
        prof.enable()
    while engine.groups:
        engine.step(finished_only=args.finished_only)
        steps += 1
    if prof:
        prof.disable()
    seconds = time.perf_counter() - t
    if prof:
        pstats.Stats(prof).sort_stats(args.sort).print_stats(25)
    return {"num_seqs": args.num_seqs, "output_len": args.output_len, "steps": steps,
            "finished_only": args.finished_only,
            "seconds": seconds, "ms_per_step": seconds / steps * 1e3, "profiled": bool(prof)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-prompt-len", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--finished-only", action="store_true",
                    help="outputs for finished requests only, as offline LLM.generate asks")
    ap.add_argument("--sort", default="cumulative", help="cProfile sort key (cumulative, tottime)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = run(args)
    print(f"{result['steps']} steps, {result['num_seqs']} sequences x {result['output_len']} tokens: "
          f"{result['ms_per_step']:.2f} ms per step{' (profiled)' if result['profiled'] else ''}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
