#!/usr/bin/env bash
# RULER at 4k on the 0.5B, bfloat16 then int4 weights, full and infinigen at budget 0.1.
O=${1:?usage: $0 OUT_DIR}; mkdir -p "$O"; O=$(cd "$O" && pwd)
M=$(realpath "${QWEN:?set QWEN to the Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF}") || exit 2
DATA=$(realpath "${DATA:?set DATA to the evaluation text folder (wikitext-2/, pg19/)}") || exit 2
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"  # the clone this script is in
for w in bf16 int4; do
  extra=""; [ $w = int4 ] && extra="--weights int4"
  echo "$w start $(date -u +%H:%M:%S)" >> $O/times.txt
  .venv/bin/infinigen bench accuracy --model $M $extra --methods full,infinigen --budget 0.1 --tasks ruler --lengths 4000 --samples 5 --batch 5 --data $DATA --out $O/ruler-4k-$w > $O/ruler-4k-$w.log 2>&1
done
echo "end $(date -u +%H:%M:%S)" >> $O/times.txt
