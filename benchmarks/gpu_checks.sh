#!/usr/bin/env bash
# Everything that needs a GPU, in one call of one H200 (the device tool's nvidia-h200):
# builds (NVRTC, on first use), checks (CUDA tests) and times (every GPU benchmark), results
# under $OUT. Steps run one after another, each under its own time limit so one slow step
# cannot starve the rest; $OUT gets the JSON results and one log (the device tool brings
# back at most 8 files). With two or more GPUs the tensor-parallel checks run at the end.
#
#     OUT=/tmp/gpu bash benchmarks/gpu_checks.sh               # everything (~17 min)
#     PARTS=speed OUT=/tmp/gpu bash benchmarks/gpu_checks.sh   # the speed figures (past one call's 10 min: use STEPS)
#     PARTS=eval OUT=/tmp/gpu bash benchmarks/gpu_checks.sh    # recovery, structured outputs,
#                                       # swap vs recompute, the paper's Fig 12 point (~9 min)
#     PARTS=serve OUT=/tmp/gpu bash benchmarks/gpu_checks.sh   # the served figures (issue 25):
#                                       # SERVE_STEPS picks among them (one device call each)
#     FULL=1 ... adds the whole decode-kernel matrix, a decode-graph profile, prefill kernel timing
#     STEPS="tests throughput" ... runs only the named steps of the parts
#
# A device call is at most 10 minutes, so a session runs the two parts in two calls.
#
# The ShareGPT workload is token ids saved on a CPU box (the GPU box has neither the data
# set nor the tokenizer):
#     python benchmarks/bench_throughput.py --save-workload bench_inputs/sharegpt_1000.json \
#         --num-requests 1000 --max-output-len 1024 --max-prompt-len 1024
#     python -m load_tests.bench --workload sharegpt --num-requests 200 \
#         --save-workload bench_inputs/sharegpt-200.json
# and bench_inputs/smollm2-tokenizer/ is the embedded model's config + tokenizer files (copied
# from its converted directory under ~/.cache/streamkv/models/) for the structured-output run.
# bench_inputs/ and .whl/ are git-ignored: name both in the device call's carry. Python packages
# the GPU image lacks (msgspec, pydantic, xgrammar, the server's starlette/uvicorn/websockets,
# jsonschema) travel as wheels in .whl/ (docs/benchmarks.md); the call starts with
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#         --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
OUT=${OUT:-/tmp/gpu_checks}
export OUT
mkdir -p "$OUT"
nvidia-smi -L
LOG=$OUT/gpu.log
M8B="--model llama3-8b --load-format dummy --dtype bfloat16 --device cuda"

step() {  # step NAME SECONDS COMMAND...: appends the whole output to $LOG
  local name=$1 limit=$2
  shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return; fi  # STEPS="a b": only those
  local t0=$SECONDS
  echo "== $name: $*" >>"$LOG"
  timeout "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG"
}

# GC_PROBE=1: every Python process records its cyclic-GC pauses (benchmarks/gc_probe), one
# line each in $OUT/gc_probe.txt at the end.
if [ "${GC_PROBE:-0}" = 1 ]; then
  export GCPROBE_DIR=$OUT/gc_probe PYTHONPATH=$PWD/benchmarks/gc_probe:$PYTHONPATH
  trap 'tail -qn1 "$GCPROBE_DIR"/* >"$OUT/gc_probe.txt" 2>/dev/null; rm -rf "$GCPROBE_DIR"' EXIT
fi

PARTS=${PARTS:-speed eval}
# The engine's defaults: max_num_seqs 1024 on an H200, the KV cache sized from memory.
SHAREGPT="--workload-file bench_inputs/sharegpt_1000.json --num-requests 1000 --max-output-len 1024 \
  --baseline-batch-sizes="

if [[ " $PARTS " == *" speed "* ]]; then
  # Checks: graphs, sampler, prefill kernel, and async scheduling on CUDA (CUDA tests skip on CPU).
  step tests 150 python3 -m pytest -q -p no:cacheprovider tests/worker/test_piecewise_graphs.py \
    tests/worker/test_sampler.py tests/worker/test_cuda_graphs.py tests/kernels/test_prefill_attention.py \
    tests/engine/test_async_scheduling_cuda.py tests/worker/test_async_cuda.py tests/executor/test_async_mp_cuda.py \
    tests/kernels/test_sampling_kernel.py
  # Which streamkv files one streaming request runs through on the GPU (docs/architecture.md,
  # "A request's lifecycle"): the embedded model's shapes with dummy weights, mp executor.
  step request_path 150 python3 benchmarks/trace_request_path.py --model bench_inputs/smollm2-tokenizer \
    --device cuda --server-arg=--load-format --server-arg=dummy --exclude-idle \
    --json-out "$OUT/request_path_cuda.json"
  # The decode GEMV (1-4 rows) and the kernels launched with programmatic dependent launch:
  # every kernel test, the decode matrix in bf16 only (fp16/fp32 in FULL=1's kernel_tests).
  step kernel_checks 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemv.py \
    tests/kernels/test_cuda_kernels.py -k "not test_paged_attention_decode or bfloat16"
  # The decode variants bench_kernels.py times (benchmarks/decode_variants.py), on the GPU.
  step variant_checks 300 python3 -m pytest -q -p no:cacheprovider tests/benchmarks/test_decode_variants.py
  if [ "${FULL:-0}" = 1 ]; then
    step kernel_tests 300 python3 -m pytest -q -x -p no:cacheprovider tests/kernels
    # Decode steps with graphs: batch 1 and 256 at context 512, GPU time split by kernel kind.
    step decode_graphs 110 python3 benchmarks/bench_decode_graphs.py --model llama3-8b --dtype bfloat16 \
      --batch-sizes 1 256 --context 512 --steps 30 --profile --profile-steps 5 --no-eager \
      --out "$OUT/decode_graphs.json"
    step prefill_kernel 60 python3 benchmarks/bench_prefill.py --kernel-only --out "$OUT/prefill_kernel.json"
  fi
  # 1,000 ShareGPT requests (every step timed) at the engine's defaults, then at the old
  # default of 256 sequences a step: what the larger batch buys, in the same call.
  step throughput 150 python3 benchmarks/bench_throughput.py $M8B $SHAREGPT --json-out "$OUT/throughput.json"
  step throughput_256 150 python3 benchmarks/bench_throughput.py $M8B $SHAREGPT --max-num-seqs 256 \
    --json-out "$OUT/throughput_256.json"
  # 400 of them x 256 tokens against transformers' own continuous batching (generate_batch) in
  # the same run, the engine (20,000 KV blocks) shut down before transformers' copy is built.
  step throughput_cb 200 python3 benchmarks/bench_throughput.py $M8B --workload-file bench_inputs/sharegpt_1000.json \
    --num-requests 400 --max-output-len 256 --baseline-batch-sizes= --num-kv-blocks 20000 \
    --cb-requests 400 --cb-output-len 256 --json-out "$OUT/throughput_cb.json"
  # Why that ratio stops short of 12x (docs/benchmarks.md, "Offline throughput"): the same
  # 400 x 256 as a workload of its own, with the per-step timeline; its 400-row decode step
  # profiled; one layer's GEMMs at every graph size from 240 to 1024 rows.
  step cb_phases 150 bash -c 'python3 -c "import json, sys; d = json.load(open(sys.argv[1]));
json.dump([[p, 256] for p, _ in d[:400]], open(sys.argv[2], \"w\"))" bench_inputs/sharegpt_1000.json \
      /tmp/sharegpt_400x256.json && python3 benchmarks/bench_throughput.py '"$M8B"' \
      --workload-file /tmp/sharegpt_400x256.json --num-requests 400 --max-output-len 256 \
      --baseline-batch-sizes= --num-kv-blocks 20000 --phases --json-out "$OUT/cb_phases.json"'
  step decode_graphs_400 110 python3 benchmarks/bench_decode_graphs.py --batch-sizes 256 400 --context 230 \
    --steps 20 --no-eager --profile --profile-steps 5 --out "$OUT/dg_400.json"
  step gemm_ladder 120 python3 benchmarks/bench_fp8_gemm.py --rows 240 248 $(seq 256 16 512) \
    $(seq 544 32 1024) --out "$OUT/gemm_ladder.json"
  # The same 1,000 without async scheduling.
  step throughput_sync 80 python3 benchmarks/bench_throughput.py $M8B $SHAREGPT --no-async-scheduling \
    --json-out "$OUT/throughput_sync.json"
  # FP8 KV cache (docs/kernels.md, "FP8 KV cache"): its CUDA kernels (cache write, decode, prefill)
  # against the torch reference over the same fp8 cache, greedy agreement on the embedded model,
  # then the throughput step's twin with an fp8 cache: same requests and memory, so fp8 holds
  # twice the blocks.
  step fp8_tests 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_kv_cache.py
  step throughput_fp8 200 python3 benchmarks/bench_throughput.py $M8B $SHAREGPT --kv-cache-dtype fp8 \
    --json-out "$OUT/throughput_fp8.json"
  # FP8 weights (docs/kernels.md, "FP8 weights"): _scaled_mm and the fused activation
  # quantization and the small-batch scale kernel against the CPU reference, graphs, the tiny
  # engine; then the throughput twin.
  step fp8w_tests 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_weights_cuda.py
  # The products alone at decode batch sizes: bf16, row-wise fp8, the small-batch path.
  step fp8_gemm 120 python3 benchmarks/bench_fp8_gemm.py --out "$OUT/fp8_gemm.json"
  step throughput_fp8w 200 python3 benchmarks/bench_throughput.py $M8B $SHAREGPT --quantization fp8 \
    --json-out "$OUT/throughput_fp8w.json"
  # Both fp8 options together.
  step throughput_fp8w_kv 200 python3 benchmarks/bench_throughput.py $M8B $SHAREGPT --quantization fp8 \
    --kv-cache-dtype fp8 --json-out "$OUT/throughput_fp8w_kv.json"
  # The multiprocess executor (a worker process at TP 1, pipelined steps) against the in-process
  # one, 400 ShareGPT requests x <= 256 tokens, same call, greedy outputs compared.
  step throughput_mp 150 python3 benchmarks/bench_throughput.py --compare-executors $M8B \
    --workload-file bench_inputs/sharegpt_1000.json --num-requests 400 --max-output-len 256 \
    --max-num-seqs 256 --num-kv-blocks 20000 --rounds 1 --json-out "$OUT/executors_async.json"
  # Decode steps with graphs at batch 1 and 256, context 512 (the whole step, GPU time by kernel kind).
  step decode_graphs_512 110 python3 benchmarks/bench_decode_graphs.py --model llama3-8b --dtype bfloat16 \
    --batch-sizes 1 256 --context 512 --steps 30 --no-eager --out "$OUT/decode_graphs.json"
  # The decode step at 256 x 512 against issue 27's 9 / 7.5 ms (docs/kernels.md), profiled:
  # bf16, the fp8 cache, fp8 weights too.
  step decode_step_512 200 bash -c 'for c in bf16: "fp8kv:--kv-cache-dtype fp8" \
      "fp8w_kv:--quantization fp8 --kv-cache-dtype fp8"; do
      python3 benchmarks/bench_decode_graphs.py --batch-sizes 1 256 --context 512 --steps 30 --no-eager \
        --max-model-len 4096 --profile --profile-steps 5 ${c#*:} --label ${c%%:*} --out "$OUT/dg512_${c%%:*}.json"
    done'
  # Decode attention alone over a 16-bit and an fp8 cache, bf16 and fp16 queries
  # (docs/kernels.md, "FP8 KV cache": what the fp8 cache's halved bytes buy).
  step attention_fp8 150 bash -c 'for q in bfloat16 float16; do for c in auto fp8; do
      python3 benchmarks/bench_kernels.py --dtype $q --kv-cache-dtype $c --bound 1024 --contexts 700 \
        --batches 8 32 64 128 256 512 --no-sweep --skip-checks --only-attention --other-groups \
        --other-heads --out "$OUT/attn_q${q}_$c.json"
    done; done'
  # Sampling modes against greedy, 400 requests x 256 tokens, one engine.
  step sampling 110 python3 benchmarks/bench_sampling.py $M8B --num-requests 400 --output-len 256 \
    --max-num-seqs 256 --json-out "$OUT/sampling.json"
  # The engine's host time per step without a model (issue 12's before/after), on this host's
  # quiet cores: 256 sequences x 256 tokens, alternating the tree before issue 12's work
  # (ae49365, unpacked by `git archive` into bench_inputs/before12 with its bench pointed at
  # $BENCH_MODEL) and this tree, three pairs.
  step engine_overhead 150 bash -c 'for i in 1 2 3; do
      (cd bench_inputs/before12 && BENCH_MODEL=$OLDPWD/bench_inputs/smollm2-tokenizer python3 \
        benchmarks/bench_engine_overhead.py --num-seqs 256 --output-len 256 --out "$OUT/overhead_before_$i.json")
      python3 benchmarks/bench_engine_overhead.py --model bench_inputs/smollm2-tokenizer --num-seqs 256 \
        --output-len 256 --modes instant --out "$OUT/overhead_after_$i.json"
    done'
  # The sampler alone at batch 256 x 128k bf16: the CUDA kernel path against the torch path.
  step sampler_only 40 python3 benchmarks/bench_sampling.py --sampler-only --device cuda --vocab-size 128256 \
    --max-num-seqs 256 --calls 20 --json-out "$OUT/sampler_only.json"
  # Sampling against greedy, the kernel and the torch path in one engine.
  step sampling_paths 110 python3 benchmarks/bench_sampling.py $M8B --num-requests 400 --output-len 256 \
    --max-num-seqs 256 --sampler-paths auto,torch --modes greedy,temp_top_p \
    --json-out "$OUT/sampling_paths.json"
  # Prefill against transformers' contiguous forward (64 x 4000, 256 x 500).
  step prefill_e2e 100 python3 benchmarks/bench_prefill.py --e2e-only --rounds 1 --out "$OUT/prefill_e2e.json"
fi

if [[ " $PARTS " == *" eval "* ]]; then
  # Worker SIGKILL / SIGSTOP under a served llama3-8b: detection, restart, first resumed token.
  # float32: the resumed text is compared with a fault-free run's, and with random weights
  # bf16 rounding flips near-tied greedy picks between a decode and a recompute.
  step recovery 120 python3 benchmarks/bench_recovery.py --model llama3-8b --device cuda --dtype float32 \
    --num-kv-blocks 4096 --max-num-seqs 8 --faults SIGKILL,SIGSTOP --json-out "$OUT/recovery_gpu.json"
  # What 5 viewers of /v1/kv/stream cost a served model on a quiet 16-core host (issue 16):
  # SmolLM2's shape and tokenizer, random weights, on the GPU.
  step kv_view 120 python3 -m tests.web.kv_view_load --viewers 5 --pairs 12 --requests 64 --concurrency 32 \
    --max-tokens 64 --out "$OUT/kv_view_gpu.json" \
    --server-args bench_inputs/smollm2-tokenizer --load-format dummy --device cuda
  # Structured outputs: first the CUDA tests (overlap vs in turn, the mask kernel and its
  # staged upload against the CPU path), then json_schema batch of 64 against the same batch
  # unconstrained: SmolLM2's shape overlapped (the GPU default) and in turn, and llama3-8b's
  # dimensions with SmolLM2's tokenizer; the mask step's host microseconds.
  step structured_tests 150 python3 -m pytest -q -p no:cacheprovider -m cuda \
    tests/engine/test_structured_overlap_cuda.py tests/engine/test_structured_outputs.py
  step structured 120 python3 benchmarks/bench_structured.py --model bench_inputs/smollm2-tokenizer \
    --load-format dummy --device cuda --dtype bfloat16 --num-requests 64 --output-len 64 --rounds 5 --phases \
    --overlap-structured --json-out "$OUT/structured_gpu.json"
  step structured_8b 240 python3 benchmarks/bench_structured.py --model bench_inputs/smollm2-tokenizer \
    --shape llama3-8b --load-format dummy --device cuda --dtype bfloat16 --num-requests 64 --output-len 64 \
    --rounds 5 --phases --json-out "$OUT/structured_gpu_8b.json"
  step structured_inturn 120 python3 benchmarks/bench_structured.py --model bench_inputs/smollm2-tokenizer \
    --load-format dummy --device cuda --dtype bfloat16 --num-requests 64 --output-len 64 --rounds 5 --phases \
    --no-overlap-structured --json-out "$OUT/structured_gpu_inturn.json"
  step mask_step 60 python3 benchmarks/bench_mask_step.py --device cuda --json-out "$OUT/mask_step_gpu.json"
  # The same comparison on this host's CPU (16 quiet cores; the 2-core box is shared and noisy):
  # float32, the CPU defaults (in turn, no async scheduling).
  step structured_cpu 150 python3 benchmarks/bench_structured.py --model bench_inputs/smollm2-tokenizer \
    --load-format dummy --device cpu --num-requests 64 --output-len 32 --rounds 2 \
    --json-out "$OUT/structured_cpu.json"
  # Fig 12's GPU point: OPT-13B, an A100-40GB's KV pool (983 blocks), 200 ShareGPT requests a rate.
  step fig12_paged 170 env OUT="$OUT" RATES=${FIG12_RATES:-6,12} MAX_DURATION=50 \
    bash load_tests/gpu_point.sh paged
  step fig12_orca_oracle 115 env OUT="$OUT" RATES=${FIG12_ORACLE_RATES:-3,6} MAX_DURATION=50 \
    bash load_tests/gpu_point.sh orca-oracle
  # Sampling modes again (penalty counts now copied without a stream sync).
  step sampling_eval 70 python3 benchmarks/bench_sampling.py $M8B --num-requests 400 --output-len 256 \
    --max-num-seqs 256 --json-out "$OUT/sampling_eval.json"
  # Fig 19a: swap out+in vs recompute, OPT-13B's shape; fits preemption_mode=auto's costs.
  step swap_recompute 80 python3 benchmarks/bench_swap_recompute.py --model opt-13b --load-format dummy \
    --dtype float16 --device cuda --recompute-block-sizes 16 --write-costs cuda \
    --json-out "$OUT/swap_recompute_gpu.json"
  cp streamkv/core/preemption_costs.json "$OUT/" 2>/dev/null
fi

# The served figures (issue 25): `streamkv serve` under vLLM benchmark_serving's default call
# (streaming /v1/completions, ignore_eos, ShareGPT text prompts) beside the offline engine on
# the same requests. bench_inputs/sharegpt_serve.json is written on a CPU box:
#     python benchmarks/bench_serve.py --save-dataset bench_inputs/sharegpt_serve.json \
#         --num-prompts 2000 --seed 2026        # 104 prompt / 297 output tokens on average
# bench_inputs/before25 is the tree before issue 25 (`git archive 37cc096 streamkv kernels_cu web`).
# A device call is at most 10 minutes: run the steps in SERVE_STEPS-sized groups.
SERVE="python3 benchmarks/bench_serve.py --model llama3-8b --dataset-file bench_inputs/sharegpt_serve.json"
E8B="--tokenizer bench_inputs/smollm2-tokenizer --load-format dummy --device cuda --dtype bfloat16"
if [[ " $PARTS " == *" serve "* ]]; then
  export PATH=/tmp/site/bin:$PATH  # py-spy, carried as a wheel
  step serve_tests 150 python3 -m pytest -q -p no:cacheprovider ${SERVE_TESTS:-tests/engine/test_shutdown_cuda.py \
    tests/hostile/test_extreme_numbers.py \
    tests/engine/test_async_scheduling_cuda.py tests/executor/test_async_mp_cuda.py}
  # The token budget: 1,000 at once, offline and served, prefix cache off (each run cold).
  for b in ${BUDGETS:-2048 4096 8192 16384}; do
    spy=""
    [ "$b" = "${SPY_BUDGET:-8192}" ] && spy="--py-spy $OUT/pyspy_b$b"
    step budget_$b 170 $SERVE --num-prompts 1000 --request-rate inf --offline $spy \
      --engine-args "$E8B --no-enable-prefix-caching --max-num-batched-tokens $b" --json-out "$OUT/serve_b$b.json"
  done
  # The server's defaults: 1,000 at once beside the offline engine, then Poisson arrivals,
  # 2,000 requests a point (long enough that a rate past capacity shows its growing queue).
  # BURSTS=N repeats the pair (offline, then served) N times: serve_burst_2.json, ...
  for i in $(seq ${BURSTS:-1}); do
    step serve_burst 170 $SERVE --num-prompts 1000 --request-rate inf --offline --engine-args "$E8B" \
      --json-out "$OUT/serve_burst$([ "$i" = 1 ] || echo "_$i").json"
  done
  # The same burst with fp8 weights and the fp8 KV cache (the fastest offline configuration).
  step serve_burst_fp8 200 $SERVE --num-prompts 1000 --request-rate inf --offline \
    --engine-args "$E8B --quantization fp8 --kv-cache-dtype fp8" --json-out "$OUT/serve_burst_fp8.json"
  # The same with py-spy attached (`--nonblocking`: it samples without stopping the server).
  step serve_burst_spy 120 $SERVE --num-prompts 1000 --request-rate inf --engine-args "$E8B" \
    --py-spy "$OUT/pyspy_burst" --json-out "$OUT/serve_burst_spy.json"
  # The event loop: uvloop writes each SSE event holding the GIL; asyncio's socket send lets
  # it go for the system call, so the engine thread can run meanwhile.
  for l in ${LOOPS:-asyncio uvloop}; do
    step serve_burst_$l 120 $SERVE --num-prompts 1000 --request-rate inf --engine-args "$E8B" \
      --server-args "--loop $l" --json-out "$OUT/serve_burst_$l.json"
  done
  # A shorter GIL switch interval (the engine thread waits less for the loop to let go).
  step serve_burst_switch02 120 env STREAMKV_GIL_SWITCH_INTERVAL_MS=0.2 $SERVE --num-prompts 1000 \
    --request-rate inf --engine-args "$E8B" --json-out "$OUT/serve_burst_switch02.json"
  # The same with Python's default GIL switch interval (5 ms; the engine thread sets 0.5 ms).
  step serve_burst_switch5 120 env STREAMKV_GIL_SWITCH_INTERVAL_MS=5 $SERVE --num-prompts 1000 \
    --request-rate inf --engine-args "$E8B" --json-out "$OUT/serve_burst_switch5.json"
  step serve_poisson 560 $SERVE --num-prompts 2000 --request-rate ${RATES:-48,40,32,24,16} --engine-args "$E8B" \
    --json-out "$OUT/serve_poisson.json"
  step serve_poisson_low 400 $SERVE --num-prompts 2000 --request-rate ${LOW_RATES:-8} --engine-args "$E8B" \
    --json-out "$OUT/serve_poisson_low.json"
  # The in-process executor (offline's default) behind the server.
  step serve_inprocess 170 $SERVE --num-prompts 1000 --request-rate inf --engine-args "$E8B" \
    --server-args "--distributed-executor-backend inprocess" --json-out "$OUT/serve_inprocess.json"
  # The tree before issue 25, its defaults (the fitted prefill cap on), same requests.
  # (--server-tree runs the server from that directory: the tokenizer's path is absolute.)
  E8B_ABS="--tokenizer $PWD/bench_inputs/smollm2-tokenizer --load-format dummy --device cuda --dtype bfloat16"
  step before_burst 200 $SERVE --num-prompts 1000 --request-rate inf --server-tree bench_inputs/before25 \
    --engine-args "$E8B_ABS" --server-args "--limit-concurrency 4096" --json-out "$OUT/before_burst.json"
  # A paired served A/B against another tree (bisecting a served regression): PAIR_TREE is
  # `git archive REV streamkv kernels_cu web` unpacked under bench_inputs/; that tree's server,
  # then this one's, PAIRS times, the same 1,000 requests at once.
  [ -n "${PAIR_TREE:-}" ] && step serve_pair 560 bash -c 'for i in $(seq ${PAIRS:-2}); do
      '"$SERVE"' --num-prompts 1000 --request-rate inf --server-tree "$PAIR_TREE" \
        --engine-args "'"$E8B_ABS"'" --json-out "$OUT/pair_old_$i.json"
      '"$SERVE"' --num-prompts 1000 --request-rate inf --engine-args "'"$E8B"'" \
        --json-out "$OUT/pair_new_$i.json"
    done'
  step before_poisson 400 $SERVE --num-prompts 2000 --request-rate ${BEFORE_RATES:-32,16} \
    --server-tree bench_inputs/before25 --engine-args "$E8B_ABS" --server-log "$OUT/before_server.log" \
    --json-out "$OUT/before_poisson.json"
fi

# The paper's evaluation on the H200 (issue 30; docs/paper.md, "Commands"): Fig 18a's
# kernel sweep and the capacity points, OPT-13B's shape on an A100-40GB's KV pool, one JSON a
# point under $OUT/h200/ (load_tests/capacity_point.sh). PAPER_GROUPS picks the groups, each
# one device call of under 10 minutes. Beside each step: its estimated device seconds (the
# simulated run's length x 0.385, the ratio the first H200 capacity points showed, + ~30 s
# of engine start) and capacity; its limit is the point's MAX_DURATION + 60 s, so a slow
# point is cut, not lost.
#     PARTS=paper PAPER_GROUPS=a OUT=$OUT bash benchmarks/gpu_checks.sh   # then b, then c
# Carry bench_inputs (sharegpt-1000.json, alpaca-3000.json: load_tests/capacity_point.sh
# says how they are made) and .whl.
if [[ " $PARTS " == *" paper "* ]]; then
  PG=" ${PAPER_GROUPS:-a b c} "
  cap() {  # cap STEP_NAME SYSTEM WORKLOAD RATE NUM_REQUESTS MAX_DURATION
    step "$1" $(($6 + 60)) env OUT="$OUT" bash load_tests/capacity_point.sh "${@:2}"
  }
  mkdir -p "$OUT/h200"
  if [[ $PG == *" a "* ]]; then  # ~370 s
    # Fig 18a: the decode kernel at block sizes 1-256 against SDPA on contiguous K/V (~60 s).
    step kernel_block_size 120 python3 benchmarks/bench_block_size.py --json-out "$OUT/h200/kernel-block-size.json"
    cap cap_sharegpt_paged paged sharegpt 20 1000 150              # ~130 s, ~10.7 req/s
    cap cap_sharegpt_orca_oracle orca-oracle sharegpt 12 1000 200  # ~180 s, ~7.2 req/s
  fi
  if [[ $PG == *" b "* ]]; then  # ~420 s
    cap cap_sharegpt_orca_pow2 orca-pow2 sharegpt 9 1000 220       # ~215 s, ~5.7 req/s
    cap cap_sharegpt_orca_max orca-max sharegpt 5 300 160           # ~150 s, ~2.7 req/s
    cap cap_alpaca_paged paged alpaca 400 3000 60                   # ~55 s, ~170 req/s
  fi
  if [[ $PG == *" c "* ]]; then  # ~430 s
    cap cap_sharegpt_ft_max ft-max sharegpt 3 300 280               # ~270 s, ~1.3 req/s
    cap cap_alpaca_orca_oracle orca-oracle alpaca 200 3000 70       # ~60 s, ~120 req/s
    # Fig 18b end to end, the small end first (the same 15,728 slots): ~100 s.
    BLOCK_SIZE=1 FIGURE=18b cap cap_sharegpt_paged_b1 paged sharegpt 20 600 90
  fi
  if [[ $PG == *" knee "* ]]; then  # ~410 s: below capacity, the knee's cross-check
    cap knee_sharegpt_paged paged sharegpt 8 1000 150              # ~165 s
    cap knee_sharegpt_orca_oracle orca-oracle sharegpt 5 1000 230  # ~245 s
  fi
  if [[ $PG == *" blocks "* ]]; then  # ~400 s: Fig 18b end to end at more block sizes
    for b in ${PAPER_BLOCKS:-256 4 64 128}; do
      BLOCK_SIZE=$b FIGURE=18b cap cap_sharegpt_paged_b$b paged sharegpt 20 600 90
    done
  fi
fi

if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  step tp_tests 90 python3 -m pytest -q -rs -p no:cacheprovider -m cuda tests/executor
  step tp2_bf16 120 python3 benchmarks/bench_throughput.py --compare-executors \
    --tensor-parallel-size 2 $M8B --random-input-len 128 --max-output-len 128 --num-requests 64 \
    --max-num-seqs 64 --rounds 1 --json-out "$OUT/tp2_llama3_8b_bf16.json"
fi
