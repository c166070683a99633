#!/usr/bin/env bash
# Everything that needs GPUs, in one call of a two-H200 machine (the device tool's
# nvidia-h200-x2), results under $OUT. Phases run what can share the machine side by side:
#   A: GPU 0 - kernel tests, then offline throughput vs transformers (llama3-8b, dummy weights)
#      GPU 1 - CUDA-graph tests, then decode steps/s with graphs vs eager
#   B: both  - tensor-parallel tests over NCCL, then TP 2 vs TP 1 throughput
# Each step has its own time limit so one slow step cannot starve the rest. $OUT gets the
# JSON results and one log per lane (the device tool brings back at most 8 files).
#
#     OUT=/tmp/gpu bash benchmarks/gpu_checks.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
nvidia-smi -L

step() {  # step LOG NAME SECONDS GPUS COMMAND...: appends the whole output to $OUT/LOG
  local log=$OUT/$1 name=$2 limit=$3 gpus=$4
  shift 4
  local t0=$SECONDS
  echo "== $name: $*" >>"$log"
  CUDA_VISIBLE_DEVICES=$gpus timeout "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$log"
}

(
  step gpu0.log kernel_tests 150 0 python3 -m pytest -q -x -p no:cacheprovider tests/kernels
  step gpu0.log throughput 150 0 python3 benchmarks/bench_throughput.py --model llama3-8b \
    --load-format dummy --device cuda --dtype bfloat16 \
    --workload-file bench_inputs/sharegpt_1000.json --num-requests 256 --max-output-len 256 \
    --max-num-seqs 256 --num-kv-blocks 20000 --baseline-batch-sizes ${BASELINE_BATCHES:-64,128} \
    --json-out "$OUT/throughput_llama3_8b.json"
) &
(
  step gpu1.log graph_tests 130 1 python3 -m pytest -q -rs -p no:cacheprovider tests/worker/test_cuda_graphs.py
  step gpu1.log decode_graphs 130 1 python3 benchmarks/bench_decode_graphs.py --model llama3-8b \
    --dtype bfloat16 --batch-sizes 1 8 32 128 --context 512 --steps 50 \
    --out "$OUT/decode_graphs.json"
) &
wait

step tp.log tp_tests 90 0,1 python3 -m pytest -q -rs -p no:cacheprovider -m cuda tests/executor
step tp.log tp2_bf16 120 0,1 python3 benchmarks/bench_throughput.py --compare-executors \
  --tensor-parallel-size 2 --model llama3-8b --load-format dummy --device cuda \
  --dtype bfloat16 --random-input-len 128 --max-output-len 128 --num-requests 64 \
  --max-num-seqs 64 --rounds 1 --json-out "$OUT/tp2_llama3_8b_bf16.json"
