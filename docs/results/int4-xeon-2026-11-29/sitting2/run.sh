#!/usr/bin/env bash
# The 0.5B's int4 rows against llama.cpp's Q4_K_M (its better setting on this machine: flash attention off), B1 x 4k
# and B4 x 4k, two rounds alternated.
cd /work/main
O=/work/runs/int4-q4k/xeon2
M=$(bash /work/shared/models/qwen2.5-coder-0.5b.sh)
B=~/.cache/infinigen_kv/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin
I4=full:weights=int4,infinigen:weights=int4
stamp() { echo "$1 $(date -u +%H:%M:%S)" >> $O/times.txt; }
date -u > $O/start.txt; git log --oneline | head -1 >> $O/start.txt
for i in 1 2; do
  stamp ours-b1-$i; .venv/bin/python scripts/dev/options_ab.py --model $M --configs $I4 --batch 1 --prompt-len 4096 --steps 32 > $O/ours-b1x4k-$i.txt 2>&1
  stamp llama-b1-$i; $B/llama-bench -m $M -p 0 -n 32 -d 4096 -fa 0 -t 2 -r 1 > $O/llama-b1x4k-$i.txt 2>&1
  stamp ours-b4-$i; .venv/bin/python scripts/dev/options_ab.py --model $M --configs $I4 --batch 4 --prompt-len 4096 --steps 24 > $O/ours-b4x4k-$i.txt 2>&1
  stamp llama-b4-$i; $B/llama-batched-bench -m $M -c 16640 -b 2048 -ub 512 -npp 4096 -ntg 32 -npl 4 -pps -t 2 -fa off > $O/llama-b4x4k-$i.txt 2>&1
done
stamp end
