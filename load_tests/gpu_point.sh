#!/usr/bin/env bash
# The GPU points of docs/paper.md's Fig 12 / 13: the real engine with OPT-13B's shape (dummy
# weights, fp16) and its A100-40GB KV pool (983 blocks of 16 tokens = 12 GiB at 800 KiB per
# token), one system per call so that each call stays within a few minutes:
#
#   # on this machine, once (the GPU box has neither the dataset nor the tokenizer):
#   .venv/bin/python -m load_tests.bench --workload sharegpt --num-requests 200 \
#       --save-workload bench_inputs/sharegpt-200.json
#   .venv/bin/python -m load_tests.bench --workload sharegpt --num-requests 1000 \
#       --save-workload bench_inputs/sharegpt-1000.json
#   .venv/bin/python -m load_tests.bench --workload alpaca --num-requests 1000 \
#       --save-workload bench_inputs/alpaca-1000.json
#   # on the GPU (run tool), one call per system; JSON + log land in $OUT:
#   bash load_tests/gpu_point.sh paged        # then orca-oracle, orca-max
#   # Alpaca-shaped (the seeded synthetic workload of load_tests/workloads.py):
#   WORKLOAD=alpaca WORKLOAD_FILE=bench_inputs/alpaca-1000.json NUM_REQUESTS=400 RATES=20,40 \
#       bash load_tests/gpu_point.sh paged
#
# Defaults: ShareGPT, the 200 requests of sharegpt-200.json, rates 3, 6, 9, 12 req/s, at most
# 75 s per point (a point cut short counts its unfinished requests as incomplete; the summary
# says how many). TAG names the output files apart (gpu-$WORKLOAD-$SYSTEM$TAG.json).
set -euo pipefail
SYSTEM=${1:?usage: gpu_point.sh paged|orca-oracle|orca-pow2|orca-max|ft-max}
OUT=${OUT:-bench_results}
RATES=${RATES:-3,6,9,12}
WORKLOAD=${WORKLOAD:-sharegpt}
WORKLOAD_FILE=${WORKLOAD_FILE:-bench_inputs/sharegpt-200.json}
NUM_REQUESTS=${NUM_REQUESTS:-200}
NAME="gpu-$WORKLOAD-$SYSTEM${TAG:-}"
mkdir -p "$OUT"
PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD ${PY:-python3} -m load_tests.bench --backend offline --model opt-13b --load-format dummy \
  --device cuda --dtype float16 --num-kv-blocks 983 --num-swap-blocks 0 --block-size 16 \
  --max-model-len 2048 --no-enable-prefix-caching --kv-allocation "$SYSTEM" \
  --workload-file "$WORKLOAD_FILE" --workload "$WORKLOAD" --num-requests "$NUM_REQUESTS" \
  --request-rate "$RATES" --max-duration ${MAX_DURATION:-75} --disable-tqdm \
  --json-out "$OUT/$NAME.json" 2>&1 | tee "$OUT/$NAME.log"
