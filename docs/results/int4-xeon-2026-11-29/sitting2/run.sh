#!/usr/bin/env bash
# The 0.5B's int4 rows against llama.cpp's Q4_K_M (its better setting on this machine: flash attention off), B1 x 4k
# and B4 x 4k, two rounds alternated.
O=${1:?usage: $0 OUT_DIR}; mkdir -p "$O"; O=$(cd "$O" && pwd)
M=$(realpath "${QWEN:?set QWEN to the Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF}") || exit 2
B=${LLAMA_BIN:-~/.cache/infinigen_kv/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin}  # scripts/llama_cpp_bench.sh builds it
I4=full:weights=int4,infinigen:weights=int4
stamp() { echo "$1 $(date -u +%H:%M:%S)" >> $O/times.txt; }
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"  # the clone this script is in
date -u > $O/start.txt; git log --oneline | head -1 >> $O/start.txt
for i in 1 2; do
  stamp ours-b1-$i; .venv/bin/python scripts/dev/options_ab.py --model $M --configs $I4 --batch 1 --prompt-len 4096 --steps 32 > $O/ours-b1x4k-$i.txt 2>&1
  stamp llama-b1-$i; $B/llama-bench -m $M -p 0 -n 32 -d 4096 -fa 0 -t 2 -r 1 > $O/llama-b1x4k-$i.txt 2>&1
  stamp ours-b4-$i; .venv/bin/python scripts/dev/options_ab.py --model $M --configs $I4 --batch 4 --prompt-len 4096 --steps 24 > $O/ours-b4x4k-$i.txt 2>&1
  stamp llama-b4-$i; $B/llama-batched-bench -m $M -c 16640 -b 2048 -ub 512 -npp 4096 -ntg 32 -npl 4 -pps -t 2 -fa off > $O/llama-b4x4k-$i.txt 2>&1
done
stamp end
