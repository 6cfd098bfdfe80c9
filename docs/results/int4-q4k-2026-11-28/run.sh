#!/usr/bin/env bash
# One sitting: the 0.5B's int4 decode at B1 x 4k (the checkout TREE, this clone by default) against llama.cpp's Q4_K_M.
O=${1:?usage: $0 OUT_DIR}; mkdir -p "$O"; O=$(cd "$O" && pwd)
M=$(realpath "${QWEN:?set QWEN to the Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF}") || exit 2
B=${LLAMA_BIN:-~/.cache/infinigen_kv/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin}  # scripts/llama_cpp_bench.sh builds it
PY=${PY:-python}
I4=full:weights=int4,infinigen:weights=int4
stamp() { echo "$1 $(date -u +%H:%M:%S)" >> $O/times.txt; }
date -u > $O/start.txt; lscpu | grep -E "Model name" >> $O/start.txt
grep -o -w -E "avx512_bf16|avx512_vnni|amx_bf16|avx2" /proc/cpuinfo | sort -u | tr '\n' ' ' >> $O/start.txt
TREE=${TREE:-$(git -C "$(dirname "$0")" rev-parse --show-toplevel)}  # the checkout measured
git -C "$TREE" log --oneline | head -1 >> $O/start.txt
run_ours() { stamp ours-$1-$2; (cd "$TREE" && PYTHONPATH=src $PY scripts/dev/options_ab.py --model $M --configs $I4 --batch 1 --prompt-len 4096 --steps 32 > $O/ours-$1-$2.txt 2>&1); }
run_ours main 1
stamp llama; $B/llama-bench -m $M -p 0 -n 32 -d 4096 -fa 0,1 -t 2 -r 3 > $O/llama-bench.txt 2>&1
run_ours main 2
run_ours main 3
stamp end
