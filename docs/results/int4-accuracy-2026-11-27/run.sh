cd /work/main
date -u > /tmp/acc4/start.txt
for W in int4 bfloat16; do
  .venv/bin/infinigen bench accuracy --methods full,infinigen --budget 0.1 --min-budget 0 --tasks ppl,passkey \
    --data ../shared/data/wikitext-2/test.txt --window 2048 --prefix 512 --windows 4 --lengths 4000 --samples 10 \
    --weights $W --out /tmp/acc4/$W > /tmp/acc4/$W.out 2> /tmp/acc4/$W.err
done
date -u > /tmp/acc4/end.txt
