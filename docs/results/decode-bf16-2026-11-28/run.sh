#!/usr/bin/env bash
# One sitting on the 0.5B: B4 x 16k in bfloat16 weights against llama.cpp's F16, and int4 weights against its Q4_K_M
# (the GGUF as given) at B1 x 4k, B4 x 4k, B1 x 16k. Decode tokens/s; ours alternated in one process (options_ab).
M=$(realpath "${QWEN:?set QWEN to the Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF}") || exit 2
B=${LLAMA_BIN:-~/.cache/infinigen_kv/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin}  # scripts/llama_cpp_bench.sh builds it
F16=~/.cache/infinigen_kv/llama.cpp/qwen2.5-coder-0.5b-instruct-q4_k_m.F16.gguf
O=${1:?usage: $0 OUT_DIR}; mkdir -p "$O"; O=$(cd "$O" && pwd)
PY=.venv/bin/python
stamp() { echo "$1 $(date -u +%H:%M:%S)" >> $O/times.txt; }
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"  # the clone this script is in
date -u > $O/start.txt
lscpu | grep -E "Model name" >> $O/start.txt
grep -o -w -E "avx512_bf16|avx512_vnni|amx_bf16|avx2" /proc/cpuinfo | sort -u | tr '\n' ' ' >> $O/start.txt
git log --oneline | head -1 >> $O/start.txt
stamp options-b4x16k
$PY scripts/dev/options_ab.py --model $M --configs full,infinigen,offload --batch 4 --prompt-len 16384 --steps 16 > $O/options_ab_b4_16k.txt 2>&1
for fa in off on; do
  stamp llama-b4x16k-fa-$fa
  $B/llama-batched-bench -m $F16 -c 65792 -b 2048 -ub 512 -npp 16384 -ntg 16 -npl 4 -pps -t 2 -fa $fa > $O/llama-b4x16k-pps-f16-fa-$fa.txt 2>&1
done
I4=full:weights=int4,infinigen:weights=int4
stamp int4-b1x4k
$PY scripts/dev/options_ab.py --model $M --configs $I4 --batch 1 --prompt-len 4096 --steps 32 > $O/options_ab_int4_b1_4k.txt 2>&1
stamp int4-b4x4k
$PY scripts/dev/options_ab.py --model $M --configs $I4 --batch 4 --prompt-len 4096 --steps 24 > $O/options_ab_int4_b4_4k.txt 2>&1
stamp int4-b1x16k
$PY scripts/dev/options_ab.py --model $M --configs $I4 --batch 1 --prompt-len 16384 --steps 24 > $O/options_ab_int4_b1_16k.txt 2>&1
stamp llama-q4-b1
$B/llama-bench -m $M -p 0 -n 32 -d 4096,16384 -fa 0,1 -t 2 -r 1 > $O/llama-bench-q4km-b1.txt 2>&1
for fa in off on; do
  stamp llama-q4-b4x4k-fa-$fa
  $B/llama-batched-bench -m $M -c 16640 -b 2048 -ub 512 -npp 4096 -ntg 32 -npl 4 -pps -t 2 -fa $fa > $O/llama-b4x4k-pps-q4km-fa-$fa.txt 2>&1
done
stamp end
date -u > $O/end.txt
