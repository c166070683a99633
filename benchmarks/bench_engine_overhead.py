"""The engine's own CPU time per step, without a model: scheduling, block tables, StepInput,
output processing, detokenization, stats. A stand-in executor answers every sample with a
random token, so the figure is what a GPU step pays on top of the model.

    python benchmarks/bench_engine_overhead.py --num-seqs 256 --output-len 256 --out overhead.json

Two executors, each run with async scheduling off and on (SchedulerConfig.async_scheduling):

- ``instant``: the step is answered inside submit. Wall and engine-thread CPU time per step
  are the engine's host cost (async on adds its bookkeeping; nothing can overlap).
- ``gpu``: a stand-in device takes --gpu-ms per step, in submission order, like a CUDA
  stream; submit returns at once and result() waits until the step's end. Synchronous, a
  step costs host + GPU; overlapped, ideally max(host, GPU).
  "host" is the engine's wall time per step outside those waits (on a busy machine more
  than its CPU time); "hidden" is the share of the time that could overlap, the shorter of
  host and GPU, that did: (host + gpu - wall) / min(host, gpu). 100% is a perfect overlap.

Prints a table; --profile prints the top of a cProfile listing of one instant run. "GC ms" is
the part of the engine CPU spent in Python's cyclic collector; ``--gc-freeze`` freezes the
start-up heap first, as ``streamkv serve`` does, so that full collections skip it.

On a shared or busy machine compare two checkouts as a ratio measured in one session:
``--against DIR`` runs this benchmark alternately on DIR's streamkv and on this one's
(--repeat times each, one process per run) and prints the min and median of each and the
ratio, e.g. a worktree of the commit before a change:

    git worktree add /tmp/before HEAD~1
    python benchmarks/bench_engine_overhead.py --modes instant --against /tmp/before --repeat 3
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import random
import statistics
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tree() -> str:
    """The checkout whose streamkv to import: --tree DIR (read before the imports), or this one."""
    argv = sys.argv
    for i, a in enumerate(argv):
        if a == "--tree" and i + 1 < len(argv):
            return os.path.abspath(argv[i + 1])
        if a.startswith("--tree="):
            return os.path.abspath(a.split("=", 1)[1])
    return _HERE


sys.path.insert(0, _tree())

from streamkv import SamplingParams  # noqa: E402
from streamkv.engine.llm_engine import LLMEngine  # noqa: E402
from streamkv.entrypoints.llm import engine_config  # noqa: E402
from streamkv.executor.base import Executor, StepHandle  # noqa: E402
from streamkv.messages import PENDING_TOKEN, SampleResult, StepInput, StepOutput  # noqa: E402
from streamkv.models.loader import load_config, resolve_model_dir  # noqa: E402


class InstantExecutor(Executor):
    """The embedded model's tokenizer and config, no model: every sample is a random token.
    Like a worker, it checks that a pending input token is one it sampled the step before."""

    resolves_pending_tokens = True

    def __init__(self, num_blocks: int, seed: int, model: str | None = None) -> None:
        self.model_dir = resolve_model_dir(model)
        self.hf_config = load_config(self.model_dir)
        self.num_blocks = num_blocks
        self.rng = random.Random(seed)
        self.last: set[int] = set()

    def num_available_blocks(self) -> tuple[int, int]:
        return self.num_blocks, 0

    def init_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        pass

    def execute(self, step: StepInput) -> StepOutput:
        for s in step.seqs:
            if s.token_ids[0] == PENDING_TOKEN and s.seq_id not in self.last:
                raise RuntimeError(
                    f"sequence {s.seq_id}'s pending token was not sampled the step before"
                )
        draw = self.rng.randrange
        out = StepOutput(
            {s.seq_id: SampleResult([draw(1000, 20000)], [-1.0]) for s in step.seqs if s.sample}
        )
        self.last = set(out.results)
        return out


class SlowDeviceExecutor(InstantExecutor):
    """A stand-in device that takes ``gpu_s`` per step, one step after another, like a CUDA
    stream: a step starts when it is submitted or when the step before ends, whichever is
    later, and ``result()`` sleeps until it ends. A timeline, not a thread: a Python thread
    would need the GIL to say it is done, which the engine holds while it works."""

    def __init__(self, num_blocks: int, seed: int, gpu_s: float, model: str | None = None) -> None:
        super().__init__(num_blocks, seed, model)
        self.gpu_s = gpu_s
        self._free_at = 0.0  # when the device ends the last step handed to it
        self.waited_s = 0.0  # the engine's time blocked in result()

    def submit(self, step: StepInput) -> StepHandle:
        out = self.execute(step)
        self._free_at = max(time.perf_counter(), self._free_at) + self.gpu_s
        return _TimedStep(out, self._free_at, self)


class _TimedStep:
    def __init__(self, out: StepOutput, done: float, executor: SlowDeviceExecutor) -> None:
        self.out, self.done, self.executor = out, done, executor

    def result(self) -> StepOutput:
        t = time.perf_counter()
        if self.done > t:
            time.sleep(self.done - t)
        self.executor.waited_s += time.perf_counter() - t
        return self.out


class _GcTimer:
    """A gc callback: the engine thread's CPU time in the cyclic collector, and how many full
    (oldest-generation) collections ran. A full one walks every tracked object, the imported
    libraries' too (~0.15 s for ~300k objects on the 2-core CI box), so without --gc-freeze
    whether one falls inside a run moves its per-step figure by ~1 ms or more."""

    def __init__(self) -> None:
        self.seconds, self.full, self._start = 0.0, 0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.thread_time()
            return
        self.seconds += time.thread_time() - self._start
        self.full += info["generation"] == 2


def _engine(args, executor: Executor, async_scheduling: bool) -> LLMEngine:
    blocks = executor.num_blocks
    cfg = engine_config(
        args.model,
        device="cpu",
        max_num_seqs=args.num_seqs,
        num_kv_blocks=blocks,
        num_swap_blocks=0,
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
    )
    engine = LLMEngine(cfg, executor)
    rng = random.Random(args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.num_seqs):
        ids = [
            rng.randrange(1000, 20000)
            for _ in range(rng.randrange(args.max_prompt_len // 8, args.max_prompt_len))
        ]
        engine.add_request(str(i), None, params, prompt_token_ids=ids)
    return engine


def run(args, mode: str, async_scheduling: bool, profile: bool = False) -> dict:
    blocks = args.num_seqs * -(-(args.max_prompt_len + args.output_len) // 16) + 16
    gpu_s = args.gpu_ms / 1e3
    executor = (
        InstantExecutor(blocks, args.seed, args.model)
        if mode == "instant"
        else SlowDeviceExecutor(blocks, args.seed, gpu_s, args.model)
    )
    engine = _engine(args, executor, async_scheduling)
    if args.gc_freeze:  # what `streamkv serve` does once the engine is up (server/app.py)
        gc.collect()
        gc.freeze()
    gc_time = _GcTimer()
    prof = cProfile.Profile() if profile else None
    steps, wall, cpu = 0, time.perf_counter(), time.thread_time()
    gc.callbacks.append(gc_time)
    if prof:
        prof.enable()
    while engine.has_unfinished_requests():
        engine.step(finished_only=args.finished_only)
        steps += 1
    if prof:
        prof.disable()
    gc.callbacks.remove(gc_time)
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    if args.gc_freeze:
        gc.unfreeze()
    if prof:
        pstats.Stats(prof).sort_stats(args.sort).print_stats(25)
    wall_ms = wall / steps * 1e3
    gpu_ms = args.gpu_ms if mode == "gpu" else 0.0
    # The host's time per step as it ran here (a busy box stretches it past its CPU time):
    # everything but the waits for the stand-in device.
    host_ms = wall_ms - (executor.waited_s / steps * 1e3 if mode == "gpu" else 0.0)
    result = {
        "mode": mode,
        "async_scheduling": engine.async_scheduling,
        "steps": steps,
        "overlapped_steps": engine.overlapped_steps,
        "wall_ms_per_step": wall_ms,
        "engine_cpu_ms_per_step": cpu / steps * 1e3,
        "host_ms_per_step": host_ms,
        "gpu_ms": gpu_ms,
        "gc_ms_per_step": gc_time.seconds / steps * 1e3,
        "full_collections": gc_time.full,
        "profiled": profile,
    }
    if mode == "gpu":
        result["ideal_ms_per_step"] = max(host_ms, gpu_ms)
        # Of the time that could overlap (the shorter of host and device), the share that did.
        result["hidden"] = (host_ms + gpu_ms - wall_ms) / min(host_ms, gpu_ms)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default=None,
        help=(
            "a local model directory whose tokenizer and "
            "config to use (default: the embedded model)"
        ),
    )
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-prompt-len", type=int, default=1000)
    ap.add_argument(
        "--gpu-ms", type=float, default=10.0, help="the stand-in device's time per step (gpu mode)"
    )
    ap.add_argument("--modes", default="instant,gpu", help="comma-separated: instant, gpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--profile", action="store_true", help="cProfile one extra instant run (async off)"
    )
    ap.add_argument(
        "--finished-only",
        action="store_true",
        help="outputs for finished requests only, as offline LLM.generate asks",
    )
    ap.add_argument("--sort", default="cumulative", help="cProfile sort key (cumulative, tottime)")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() the heap before the steps, as `streamkv serve` does after start-up",
    )
    ap.add_argument(
        "--tree", default=None, help="the checkout whose streamkv to run (default: this one)"
    )
    ap.add_argument(
        "--against",
        default=None,
        help="another checkout: run both alternately, one process per run, and compare",
    )
    ap.add_argument("--repeat", type=int, default=1, help="with --against: runs of each checkout")
    ap.add_argument(
        "--json-rows", action="store_true", help=argparse.SUPPRESS
    )  # a child of --against
    args = ap.parse_args()
    if args.against:
        return _compare(args)
    rows = [run(args, mode, a) for mode in args.modes.split(",") for a in (False, True)]
    if args.json_rows:
        print(json.dumps(rows))
        return 0
    if args.profile:
        run(args, "instant", False, profile=True)
    print(
        f"{args.num_seqs} sequences x {args.output_len} tokens, prompts < {args.max_prompt_len}"
        f"{', finished-only outputs' if args.finished_only else ''}"
        f"{', gc frozen' if args.gc_freeze else ''}"
    )
    print(
        f"{'executor':<9} {'async':<6} {'steps':>6} "
        f"{'overlapped':>10} {'engine CPU ms':>13} {'host ms':>8} "
        f"{'GPU ms':>7} {'wall ms':>8} {'max(host,GPU)':>13} "
        f"{'hidden':>7} {'GC ms':>6} {'full GCs':>8}"
    )
    for r in rows:
        ideal = f"{r['ideal_ms_per_step']:.2f}" if "ideal_ms_per_step" in r else "-"
        hidden = f"{r['hidden']:.0%}" if "hidden" in r else "-"
        print(
            f"{r['mode']:<9} {'on' if r['async_scheduling'] else 'off':<6} "
            f"{r['steps']:>6} {r['overlapped_steps']:>10} "
            f"{r['engine_cpu_ms_per_step']:>13.2f} "
            f"{r['host_ms_per_step']:>8.2f} {r['gpu_ms']:>7.1f} "
            f"{r['wall_ms_per_step']:>8.2f} {ideal:>13} {hidden:>7} "
            f"{r['gc_ms_per_step']:>6.2f} {r['full_collections']:>8}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "runs": rows}, f, indent=2)
    return 0


def _child_argv(args, tree: str) -> list[str]:
    argv = [
        sys.executable,
        os.path.abspath(__file__),
        "--tree",
        tree,
        "--json-rows",
        "--num-seqs",
        str(args.num_seqs),
        "--output-len",
        str(args.output_len),
        "--max-prompt-len",
        str(args.max_prompt_len),
        "--gpu-ms",
        str(args.gpu_ms),
        "--modes",
        args.modes,
        "--seed",
        str(args.seed),
    ]
    if args.model:
        argv += ["--model", args.model]
    if args.finished_only:
        argv.append("--finished-only")
    if args.gc_freeze:
        argv.append("--gc-freeze")
    return argv


def _compare(args) -> int:
    """Alternate runs of two checkouts (--against first, then this one's) and compare their
    engine CPU and wall ms per step: min, median, and this / against of each."""
    trees = {"against": os.path.abspath(args.against), "this": _tree()}
    runs: dict[str, list[list[dict]]] = {k: [] for k in trees}
    for _ in range(args.repeat):
        for name, tree in trees.items():
            done = subprocess.run(
                _child_argv(args, tree), check=True, capture_output=True, text=True
            )
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(
        f"{args.num_seqs} sequences x {args.output_len} tokens, prompts < {args.max_prompt_len}"
        f"{', finished-only outputs' if args.finished_only else ''}"
        f"{', gc frozen' if args.gc_freeze else ''}; "
        f"{args.repeat} alternating runs each"
    )
    print(f"against: {trees['against']}\nthis:    {trees['this']}")
    print(
        f"{'executor':<9} {'async':<6} {'figure':<15} {'against min':>11} {'median':>7} "
        f"{'this min':>9} {'median':>7} {'ratio min':>9} {'median':>7}"
    )
    table = []
    for i, row in enumerate(runs["this"][0]):
        for key in ("engine_cpu_ms_per_step", "wall_ms_per_step", "gc_ms_per_step"):
            a = [r[i][key] for r in runs["against"]]
            t = [r[i][key] for r in runs["this"]]
            fig = {
                "mode": row["mode"],
                "async_scheduling": row["async_scheduling"],
                "figure": key,
                "against": a,
                "this": t,
                "ratio_min": min(t) / min(a),
                "ratio_median": statistics.median(t) / statistics.median(a),
            }
            table.append(fig)
            print(
                f"{row['mode']:<9} {'on' if row['async_scheduling'] else 'off':<6} "
                f"{key.split('_ms')[0]:<15} "
                f"{min(a):>11.2f} {statistics.median(a):>7.2f} "
                f"{min(t):>9.2f} {statistics.median(t):>7.2f} "
                f"{fig['ratio_min']:>9.2f} {fig['ratio_median']:>7.2f}"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"args": vars(args), "trees": trees, "comparison": table, "runs": runs}, f, indent=2
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
