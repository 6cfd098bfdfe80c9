#!/usr/bin/env bash
M=$(realpath "${QWEN:?set QWEN to the Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF}") || exit 2
O=${1:?usage: $0 OUT_DIR}; mkdir -p "$O"; O=$(cd "$O" && pwd)
DATA=$(realpath "${DATA:?set DATA to the evaluation text folder (wikitext-2/, pg19/)}") || exit 2
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"  # the clone this script is in
date -u > $O/start.txt
for W in int4 bfloat16; do
  .venv/bin/infinigen bench accuracy --model $M --methods full,infinigen --budget 0.1 --min-budget 0 --tasks ppl,passkey \
    --data $DATA/wikitext-2/test.txt --window 2048 --prefix 512 --windows 4 --lengths 4000 --samples 10 \
    --weights $W --out $O/$W > $O/$W.out 2> $O/$W.err
done
date -u > $O/end.txt
