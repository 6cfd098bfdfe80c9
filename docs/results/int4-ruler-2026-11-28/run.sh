#!/usr/bin/env bash
cd /work/main
for w in bf16 int4; do
  extra=""; [ $w = int4 ] && extra="--weights int4"
  echo "$w start $(date -u +%H:%M:%S)" >> /work/runs/ruler-int4-times.txt
  .venv/bin/infinigen bench accuracy --model /root/.cache/qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf $extra --methods full,infinigen --budget 0.1 --tasks ruler --lengths 4000 --samples 5 --batch 5 --data /work/shared/data --out /work/runs/ruler-4k-$w > /work/runs/ruler-4k-$w.log 2>&1
done
echo "end $(date -u +%H:%M:%S)" >> /work/runs/ruler-int4-times.txt
