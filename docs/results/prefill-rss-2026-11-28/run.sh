# Peak memory of a 32k prefill, commit 56224ee (a chunk over a long past reads the stored bfloat16 rows; masks made
# in place). RSS does not depend on the machine's load: these ran beside an accuracy run. The `before-*` files are
# the same commands at commit a50fab9, alone on the machine (09:47 UTC), `infinigen-calibrating` with an empty
# calibration directory (the calibration in the same process).
IG=infinigen
for m in full infinigen; do
  /usr/bin/time -v $IG generate --model gemma3-270m --prompt-file doc32k.txt --max-new-tokens 16 --method $m > gemma-$m.out 2> gemma-$m.err
  /usr/bin/time -v $IG generate --model QWEN --prompt-file doc32k.txt --max-new-tokens 16 --method $m > qwen-$m.out 2> qwen-$m.err
done
