cd /work/main
M=$(../shared/models/qwen2.5-coder-0.5b.sh)
date -u > /tmp/acc5/start.txt
for W in int4 bfloat16; do
  .venv/bin/infinigen bench accuracy --model $M --methods full,infinigen --budget 0.1 --min-budget 0 --tasks ppl,passkey \
    --data ../shared/data/wikitext-2/test.txt --window 2048 --prefix 512 --windows 4 --lengths 4000 --samples 10 \
    --weights $W --out /tmp/acc5/$W > /tmp/acc5/$W.out 2> /tmp/acc5/$W.err
done
date -u > /tmp/acc5/end.txt
