#!/bin/bash
# HT's second GPU call: the token-mask kernel tests, then bench_structured overlapped vs in turn at 64 and 256 tokens.
B="python3 benchmarks/bench_structured.py --model bench_inputs/smollm2-tokenizer --load-format dummy --device cuda --dtype bfloat16 --num-requests 64"
timeout 30 python3 -m pytest -q -p no:cacheprovider tests/engine/test_structured_outputs.py -k kernel > $OUT/tests.txt 2>&1
tail -n 2 $OUT/tests.txt
for L in 64 256; do
  R=$([ $L = 64 ] && echo 5 || echo 2)
  for ov in overlap no-overlap; do
    ph=$([ $L = 64 ] && echo "--phases" || echo "")
    timeout 40 $B --output-len $L --rounds $R --$ov-structured $ph --json-out $OUT/s_${L}_${ov}.json > $OUT/s_${L}_${ov}.txt 2>&1
    echo "== L=$L $ov"; grep -a -E "^round|json_schema / unc|grammar's host|^json_schema  |^unconstrained  |outputs " $OUT/s_${L}_${ov}.txt | tr '\n' ';'; echo
  done
done
