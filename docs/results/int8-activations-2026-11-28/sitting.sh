#!/bin/bash
# int8 activations: kernel A/B and decode-mode perplexity, old (BEFORE: a checkout of the code before) vs new (this
# clone), one sitting
set -x
OUT=${1:?usage: $0 OUT_DIR}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
BEFORE=${BEFORE:?set BEFORE to a checkout of the code before}
DATA=$(realpath "${DATA:?set DATA to the evaluation text folder (wikitext-2/, pg19/)}") || exit 2
QWEN=$(realpath "${QWEN:?set QWEN to the Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF}") || exit 2
PY=${PY:-python}
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"  # the clone this script is in
date -u
for B in 1 4; do
  for REV in 7075d15 a174e9a; do
    PYTHONPATH=$PWD/src:scripts/dev $PY scripts/dev/kernel_ab.py --rev $REV --kernel linear --weights int8 --batch $B --threads 2 2>&1 | tail -1
  done
done
date -u
for src in "$BEFORE" "$PWD"; do
  for M in default qwen; do
    if [ $M = default ]; then MODEL=""; W=4; else MODEL="--model $QWEN"; W=1; fi
    PYTHONPATH=$src/src $PY -m infinigen_kv.cli bench accuracy $MODEL --methods full,infinigen --budget 0.1 --min-budget 0 \
      --tasks ppl --data $DATA --window 2048 --prefix 512 --windows $W --weights int8 \
      --out $OUT/ppl-$M-$(basename $src) 2>&1 | tail -4
    date -u
  done
done
