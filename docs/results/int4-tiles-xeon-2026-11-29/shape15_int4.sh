#!/usr/bin/env bash
# The int4 cells of scripts/dev/shape15_sitting.sh (Qwen2.5-1.5B's shape, random weights, its Q4_K_M GGUF): ours at
# B1 x 4k and B4 x 4k (options_ab: full and infinigen alternated) against llama.cpp with flash attention off (its
# better setting at both cells on this Xeon in the full sitting).
O=${1:?usage: bash shape15_int4.sh OUT_DIR}; mkdir -p "$O"
S=~/.cache/infinigen_kv/llama.cpp/shape15
B=${LLAMA_BIN:-~/.cache/infinigen_kv/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin}  # scripts/llama_cpp_bench.sh builds it
PY=${PY:-python}
Q=$S/qwen2.5-1.5b-shape-q4_k_m.gguf
stamp() { echo "$1 $(date -u +%H:%M:%S)" >> $O/times.txt; }
date -u > $O/start.txt; lscpu | grep -E "Model name" >> $O/start.txt
git log --oneline | head -1 >> $O/start.txt
stamp ours-q4-b1x4k
$PY scripts/dev/options_ab.py --model $Q --batch 1 --prompt-len 4096 --steps 24 \
  --configs full:weights=int4,infinigen:weights=int4 > $O/ours-int4-b1x4k.txt 2>&1
stamp llama-q4_k_m-b1x4k
$B/llama-bench -m $Q -p 0 -n 32 -d 4096 -fa 0 -t 2 -r 1 > $O/llama-bench-q4_k_m.txt 2>&1
stamp ours-q4-b4x4k
$PY scripts/dev/options_ab.py --model $Q --batch 4 --prompt-len 4096 --steps 16 \
  --configs full:weights=int4,infinigen:weights=int4 > $O/ours-int4-b4x4k.txt 2>&1
stamp llama-q4_k_m-b4x4k-fa-off
$B/llama-batched-bench -m $Q -c 16640 -b 2048 -ub 512 -npp 4096 -ntg 32 -npl 4 -pps -t 2 -fa off \
  > $O/llama-b4x4k-q4_k_m-fa-off.txt 2>&1
stamp end
