#!/usr/bin/env bash
# Peak memory of a 32k prefill, commit 56224ee (a chunk over a long past reads the stored bfloat16 rows; masks made
# in place). RSS does not depend on the machine's load: these ran beside an accuracy run. The `before-*` files are
# the same commands at commit a50fab9, alone on the machine (09:47 UTC), `infinigen-calibrating` with an empty
# calibration directory (the calibration in the same process).
#   bash run.sh OUT DOC QWEN.gguf     DOC: the prompt file (the start of the WikiText-2 test text, ~32k tokens)
OUT=${1:?usage: bash run.sh OUT DOC QWEN.gguf}; DOC=${2:?usage: bash run.sh OUT DOC QWEN.gguf}
QWEN=${3:?usage: bash run.sh OUT DOC QWEN.gguf}
IG=${IG:-infinigen}
mkdir -p "$OUT"
for m in full infinigen; do
  /usr/bin/time -v $IG generate --model gemma3-270m --prompt-file "$DOC" --max-new-tokens 16 --method $m > "$OUT/gemma-$m.out" 2> "$OUT/gemma-$m.err"
  /usr/bin/time -v $IG generate --model "$QWEN" --prompt-file "$DOC" --max-new-tokens 16 --method $m > "$OUT/qwen-$m.out" 2> "$OUT/qwen-$m.err"
done
