#!/usr/bin/env bash
# B4 x 4k, int4 rows against llama.cpp's Q4_K_M (fa off and on), three rounds alternated in one sitting.
O=${1:?usage: $0 OUT_DIR}; mkdir -p "$O"; O=$(cd "$O" && pwd)
M=$(realpath "${QWEN:?set QWEN to the Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF}") || exit 2
B=${LLAMA_BIN:-~/.cache/infinigen_kv/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin}  # scripts/llama_cpp_bench.sh builds it
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"  # the clone this script is in
date -u > $O/start.txt; git log --oneline | head -1 >> $O/start.txt
for i in 1 2 3; do
  echo "round $i $(date -u +%H:%M:%S)" >> $O/times.txt
  .venv/bin/python scripts/dev/options_ab.py --model $M --configs full:weights=int4,infinigen:weights=int4 --batch 4 --prompt-len 4096 --steps 24 > $O/ours-$i.txt 2>&1
  for fa in off on; do
    $B/llama-batched-bench -m $M -c 16640 -b 2048 -ub 512 -npp 4096 -ntg 32 -npl 4 -pps -t 2 -fa $fa > $O/llama-fa-$fa-$i.txt 2>&1
  done
done
date -u > $O/end.txt
