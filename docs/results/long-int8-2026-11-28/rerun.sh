#!/usr/bin/env bash
# llama.cpp Q8_0, B1 x 32k, flash attention off, alone (the first run shared the cores with a server benchmark)
B=${LLAMA_BIN:-~/.cache/infinigen_kv/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin}  # scripts/llama_cpp_bench.sh builds it
Q8=~/.cache/infinigen_kv/llama.cpp/qwen2.5-coder-0.5b-instruct-q4_k_m.Q8_0.gguf
O=${1:?usage: $0 OUT_DIR}; mkdir -p "$O"; O=$(cd "$O" && pwd)
echo "llama-q8-b1x32k-fa-off-rerun $(date -u +%H:%M:%S)" >> $O/times.txt
$B/llama-batched-bench -m $Q8 -c 32256 -b 2048 -ub 512 -npp 32000 -ntg 16 -npl 1 -t 2 -fa off > $O/llama-b1x32k-q8-fa-off.txt 2>&1
echo "end-rerun $(date -u +%H:%M:%S)" >> $O/times.txt
