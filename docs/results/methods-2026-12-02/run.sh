#!/bin/sh
# The methods side by side on the 0.5B (Qwen2.5-Coder-0.5B-Instruct, its Q4_K_M GGUF at its own precision).
#   sh run.sh MODEL.gguf DATA_DIR OUT_DIR [SAMPLES]
# DATA_DIR: a folder with pg19/*.txt (RULER's essay haystack). Reruns with more SAMPLES go on from OUT_DIR (--resume).
set -e
USAGE="usage: sh run.sh MODEL.gguf DATA_DIR OUT_DIR [SAMPLES]"
MODEL=$(realpath "${1:?$USAGE}") DATA=$(realpath "${2:?$USAGE}") OUT=${3:?$USAGE} SAMPLES=${4:-1}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"  # the clone this script is in
METHODS=full,infinigen,quest,shadowkv,snapkv,h2o,streaming
C=full
for m in infinigen quest shadowkv snapkv h2o streaming; do for b in 0.02 0.1; do C=$C,$m:budget=$b:min_budget=0; done; done
# decode at B1 x 32k: one prefill teed into every cache, steps alternated between them
python scripts/dev/options_ab.py --model "$MODEL" --configs "$C" --batch 1 --prompt-len 32768 --steps 16 \
    > "$OUT/speed-b1-32k.md"
# RULER at 16k: 11 tasks, budgets 1%, 2%, 5%, 10% and 512 tokens, no floor, one prefill a prompt for every cache
infinigen bench accuracy --model "$MODEL" --methods $METHODS --budget 0.01,0.02,0.05,0.1,512 --tasks ruler \
    --lengths 16000 --samples "$SAMPLES" --batch 4 --data "$DATA" --out "$OUT/ruler-16k" --resume
