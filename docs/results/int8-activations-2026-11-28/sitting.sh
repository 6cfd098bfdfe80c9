#!/bin/bash
# int8 activations: kernel A/B and decode-mode perplexity, old (main) vs new (dev), one sitting
set -x
OUT=/work/ruler-out/int8act; mkdir -p $OUT
QWEN=$(bash /work/shared/models/qwen2.5-coder-0.5b.sh)
PY=/work/main/.venv/bin/python
cd /work/dev
date -u
for B in 1 4; do
  for REV in 7075d15 a174e9a; do
    PYTHONPATH=/work/dev/src:/work/dev/scripts/dev $PY scripts/dev/kernel_ab.py --rev $REV --kernel linear --weights int8 --batch $B --threads 2 2>&1 | tail -1
  done
done
date -u
for src in main dev; do
  for M in default qwen; do
    if [ $M = default ]; then MODEL=""; W=4; else MODEL="--model $QWEN"; W=1; fi
    PYTHONPATH=/work/$src/src $PY -m infinigen_kv.cli bench accuracy $MODEL --methods full,infinigen --budget 0.1 --min-budget 0 \
      --tasks ppl --data /work/shared/data --window 2048 --prefix 512 --windows $W --weights int8 \
      --out $OUT/ppl-$M-$src 2>&1 | tail -4
    date -u
  done
done
