#!/usr/bin/env bash
# B4 x 4k, int4 rows against llama.cpp's Q4_K_M (fa off and on), three rounds alternated in one sitting.
cd /work/main
O=/work/runs/int4-q4k/b4; mkdir -p $O
M=$(bash /work/shared/models/qwen2.5-coder-0.5b.sh)
B=~/.cache/infinigen_kv/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin
date -u > $O/start.txt; git log --oneline | head -1 >> $O/start.txt
for i in 1 2 3; do
  echo "round $i $(date -u +%H:%M:%S)" >> $O/times.txt
  .venv/bin/python scripts/dev/options_ab.py --model $M --configs full:weights=int4,infinigen:weights=int4 --batch 4 --prompt-len 4096 --steps 24 > $O/ours-$i.txt 2>&1
  for fa in off on; do
    $B/llama-batched-bench -m $M -c 16640 -b 2048 -ub 512 -npp 4096 -ntg 32 -npl 4 -pps -t 2 -fa $fa > $O/llama-fa-$fa-$i.txt 2>&1
  done
done
date -u > $O/end.txt
