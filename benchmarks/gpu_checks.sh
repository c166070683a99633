#!/usr/bin/env bash
# Everything that needs a GPU, in one call of one H200 (the device tool's nvidia-h200):
# builds (NVRTC, on first use), checks (CUDA tests) and times (every GPU benchmark), results
# under $OUT. Steps run one after another, each under its own time limit so one slow step
# cannot starve the rest; $OUT gets the JSON results and one log (the device tool brings
# back at most 8 files). With two or more GPUs the tensor-parallel checks run at the end.
#
#     OUT=/tmp/gpu bash benchmarks/gpu_checks.sh          # the session's figures
#     FULL=1 OUT=/tmp/gpu bash benchmarks/gpu_checks.sh   # + the whole decode-kernel matrix
#
# The ShareGPT workload is token ids saved on a CPU box (the GPU box has neither the data
# set nor the tokenizer):
#     python benchmarks/bench_throughput.py --save-workload bench_inputs/sharegpt_1000.json \
#         --num-requests 1000 --max-output-len 1024 --max-prompt-len 1024
# bench_inputs/ and .whl/ are git-ignored: name both in the device call's carry. Python packages
# the GPU image lacks (msgspec) travel as wheels in .whl/ (docs/benchmarks.md).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
nvidia-smi -L
LOG=$OUT/gpu.log
M8B="--model llama3-8b --load-format dummy --dtype bfloat16 --device cuda"

step() {  # step NAME SECONDS COMMAND...: appends the whole output to $LOG
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "== $name: $*" >>"$LOG"
  timeout "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG"
}

# Checks: the kernels this session changed, the graphs, the sampler (CUDA tests skip on CPU).
step tests 120 python3 -m pytest -q -p no:cacheprovider tests/worker/test_piecewise_graphs.py \
  tests/worker/test_sampler.py tests/worker/test_cuda_graphs.py tests/kernels/test_prefill_attention.py
if [ "${FULL:-0}" = 1 ]; then
  step kernel_tests 300 python3 -m pytest -q -x -p no:cacheprovider tests/kernels
  # Decode steps with graphs: batch 1 and 256 at context 512, GPU time split by kernel kind.
  step decode_graphs 110 python3 benchmarks/bench_decode_graphs.py --model llama3-8b --dtype bfloat16 \
    --batch-sizes 1 256 --context 512 --steps 30 --profile --profile-steps 5 --no-eager \
    --out "$OUT/decode_graphs.json"
  step prefill_kernel 60 python3 benchmarks/bench_prefill.py --kernel-only --out "$OUT/prefill_kernel.json"
fi

# 1,000 ShareGPT requests (every step timed), and 400 of them x 256 tokens against
# transformers' own continuous batching (generate_batch) in the same run.
step throughput 200 python3 benchmarks/bench_throughput.py $M8B \
  --workload-file bench_inputs/sharegpt_1000.json --num-requests 1000 --max-output-len 1024 \
  --max-num-seqs 256 --num-kv-blocks 20000 --baseline-batch-sizes "" --step-report \
  --cb-requests ${CB_REQUESTS:-400} --cb-output-len 256 --json-out "$OUT/throughput.json"

# Sampling modes against greedy, 400 requests x 256 tokens, one engine.
step sampling 110 python3 benchmarks/bench_sampling.py $M8B --num-requests 400 --output-len 256 \
  --max-num-seqs 256 --json-out "$OUT/sampling.json"

# Prefill against transformers' contiguous forward, and the step budget's sweep: the engine
# at the default budget (2048) and at 8192, on prompts and on ShareGPT.
step prefill_e2e 100 python3 benchmarks/bench_prefill.py --e2e-only --rounds 1 --out "$OUT/prefill_e2e.json"
step block_size_tests 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_cuda_kernels.py \
  -k new_block_sizes
step prefill_e2e_8192 70 python3 benchmarks/bench_prefill.py --e2e-only --rounds 1 \
  --max-num-batched-tokens 8192 --out "$OUT/prefill_e2e_8192.json"
step throughput_8192 80 python3 benchmarks/bench_throughput.py $M8B \
  --workload-file bench_inputs/sharegpt_1000.json --num-requests 1000 --max-output-len 1024 \
  --max-num-seqs 256 --num-kv-blocks 20000 --baseline-batch-sizes "" --step-report \
  --max-num-batched-tokens 8192 --json-out "$OUT/throughput_8192.json"

if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  step tp_tests 90 python3 -m pytest -q -rs -p no:cacheprovider -m cuda tests/executor
  step tp2_bf16 120 python3 benchmarks/bench_throughput.py --compare-executors \
    --tensor-parallel-size 2 $M8B --random-input-len 128 --max-output-len 128 --num-requests 64 \
    --max-num-seqs 64 --rounds 1 --json-out "$OUT/tp2_llama3_8b_bf16.json"
fi
