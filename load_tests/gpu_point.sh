#!/usr/bin/env bash
# The GPU point of docs/paper.md's Fig 12 (ShareGPT): the real engine with OPT-13B's shape
# (dummy weights, fp16) and its A100-40GB KV pool (983 blocks of 16 tokens = 12 GiB at
# 800 KiB per token), one system per call so that each call stays within ~6 minutes:
#
#   # on this machine, once (the GPU box has neither the dataset nor the tokenizer):
#   .venv/bin/python -m load_tests.bench --workload sharegpt --num-requests 200 \
#       --save-workload bench_inputs/sharegpt-200.json
#   # on the GPU (run tool), one call per system; JSON + log land in $OUT:
#   bash load_tests/gpu_point.sh paged        # then orca-oracle, orca-max
#
# Rates 3, 6, 9, 12 req/s, 200 requests each, at most 75 s per point (a point cut short
# counts its unfinished requests as incomplete; the summary says how many).
set -euo pipefail
SYSTEM=${1:?usage: gpu_point.sh paged|orca-oracle|orca-pow2|orca-max|ft-max}
OUT=${OUT:-bench_results}
RATES=${RATES:-3,6,9,12}
mkdir -p "$OUT"
PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD ${PY:-python3} -m load_tests.bench --backend offline --model opt-13b --load-format dummy \
  --device cuda --dtype float16 --num-kv-blocks 983 --num-swap-blocks 0 --block-size 16 \
  --max-model-len 2048 --no-enable-prefix-caching --kv-allocation "$SYSTEM" \
  --workload-file bench_inputs/sharegpt-200.json --workload sharegpt --num-requests 200 \
  --request-rate "$RATES" --max-duration ${MAX_DURATION:-75} --disable-tqdm \
  --json-out "$OUT/gpu-sharegpt-$SYSTEM.json" 2>&1 | tee "$OUT/gpu-sharegpt-$SYSTEM.log"
