#!/usr/bin/env bash
# One capacity point of docs/paper.md ("Commands", issue 30): the real engine with
# OPT-13B's shape (dummy fp16 weights on CUDA) and an A100-40GB's KV pool (15,728 token
# slots: 983 blocks of 16), one system, one workload, one rate past its knee. Writes one JSON
# under $OUT/h200/ (load_tests/capacity.py: completed_req_s, normalized latency, batched
# requests, KV shares, device, and a sample of 4,000 steps for load_tests/fit_steps.py); the
# sweep JSON goes to $SCRATCH, the summary to stdout.
#
#   bash load_tests/capacity_point.sh SYSTEM WORKLOAD RATE NUM_REQUESTS MAX_DURATION_S
#   bash load_tests/capacity_point.sh paged sharegpt 20 1000 150
#   BLOCK_SIZE=256 FIGURE=18b bash load_tests/capacity_point.sh paged sharegpt 20 1000 150
#   SIM=1 bash load_tests/capacity_point.sh paged sharegpt 20 50 600   # the CPU, simulated model
#   SIM=1 SIM_ARGS="--sim-base-ms 8 --sim-kv-us 0.2" bash load_tests/capacity_point.sh ...
#
# The requests are token ids saved on a CPU box (the GPU box has neither data nor tokenizer):
#   python -m load_tests.bench --workload sharegpt --num-requests 1000 --save-workload bench_inputs/sharegpt-1000.json
#   python -m load_tests.bench --workload alpaca --num-requests 3000 --save-workload bench_inputs/alpaca-3000.json
# A point ends at MAX_DURATION_S whatever is left (cut requests count as incomplete; the
# capacity is read from the completions): keep the caller's time limit above it plus ~60 s
# of engine start, or the point writes nothing.
set -euo pipefail
SYSTEM=${1:?usage: capacity_point.sh SYSTEM WORKLOAD RATE NUM_REQUESTS MAX_DURATION_S}
WORKLOAD=${2:?workload: sharegpt or alpaca}
RATE=${3:?rate}
NUM=${4:?number of requests}
MAX_DURATION=${5:?seconds at most}
OUT=${OUT:-bench_results}
SCRATCH=${SCRATCH:-/tmp/paper_sweeps}
BS=${BLOCK_SIZE:-16}
case $WORKLOAD in
  sharegpt) FILE=${WORKLOAD_FILE:-bench_inputs/sharegpt-1000.json} ;;
  alpaca) FILE=${WORKLOAD_FILE:-bench_inputs/alpaca-3000.json} ;;
  *) echo "capacity_point.sh: workload must be sharegpt or alpaca" >&2; exit 2 ;;
esac
LABEL=$SYSTEM
[ "$BS" = 16 ] || LABEL=$SYSTEM-b$BS
if [ "${SIM:-0}" = 1 ]; then
  # shellcheck disable=SC2206  # SIM_ARGS: --sim-* flags, split on spaces on purpose
  MODEL=(--simulate ${SIM_ARGS:-})
else
  MODEL=(--load-format dummy --device cuda --dtype float16)
fi
mkdir -p "$SCRATCH" "$OUT/h200"
PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD ${PY:-python3} -m load_tests.bench --backend offline --model opt-13b \
  "${MODEL[@]}" --num-kv-blocks $((15728 / BS)) --num-swap-blocks 0 --block-size "$BS" --max-model-len 2048 \
  --no-enable-prefix-caching --kv-allocation "$SYSTEM" --label "$LABEL" --workload "$WORKLOAD" \
  --workload-file "$FILE" --num-requests "$NUM" --request-rate "$RATE" --max-duration "$MAX_DURATION" \
  --disable-tqdm --record-steps "${RECORD_STEPS:-4000}" --figure "${FIGURE:-12}" --point-dir "$OUT/h200" \
  --json-out "$SCRATCH/$WORKLOAD-$LABEL-$RATE.json"
