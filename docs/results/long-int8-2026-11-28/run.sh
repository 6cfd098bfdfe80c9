#!/usr/bin/env bash
# One sitting on the 0.5B with int8 weights (q8_0 rows) against llama.cpp's Q8_0 copy of the same GGUF:
# decode at B1 x 32k and B4 x 16k (ours alternated in one process, options_ab), llama.cpp with flash attention off / on
# and, at B4 x 16k, on with q8_0 K/V.
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"  # the clone this script is in
export PYTHONPATH=$PWD/src
M=$(realpath "${QWEN:?set QWEN to the Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF}") || exit 2
B=${LLAMA_BIN:-~/.cache/infinigen_kv/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin}  # scripts/llama_cpp_bench.sh builds it
Q8=~/.cache/infinigen_kv/llama.cpp/qwen2.5-coder-0.5b-instruct-q4_k_m.Q8_0.gguf
O=${1:?usage: $0 OUT_DIR}; mkdir -p "$O"; O=$(cd "$O" && pwd)
PY=${PY:-python}
stamp() { echo "$1 $(date -u +%H:%M:%S)" >> $O/times.txt; }
date -u > $O/start.txt
lscpu | grep -E "Model name" >> $O/start.txt
grep -m1 -E "^model\s*:" /proc/cpuinfo >> $O/start.txt
grep -o -w -E "avx512_bf16|avx512_vnni|avx512_fp16|amx_bf16|avx2" /proc/cpuinfo | sort -u | tr '\n' ' ' >> $O/start.txt
git log --oneline | head -1 >> $O/start.txt
I8=full:weights=int8,infinigen:weights=int8,offload:weights=int8
stamp options-int8-b1x32k
$PY scripts/dev/options_ab.py --model $M --configs $I8 --batch 1 --prompt-len 32000 --steps 16 > $O/options_ab_int8_b1_32k.txt 2>&1
stamp options-int8-b4x16k
$PY scripts/dev/options_ab.py --model $M --configs $I8 --batch 4 --prompt-len 16384 --steps 16 > $O/options_ab_int8_b4_16k.txt 2>&1
for s in off:f16 on:f16 on:q8_0; do
  fa=${s%%:*}; ct=${s#*:}
  stamp llama-q8-b4x16k-fa-$fa-$ct
  $B/llama-batched-bench -m $Q8 -c 65792 -b 2048 -ub 512 -npp 16384 -ntg 16 -npl 4 -pps -t 2 -fa $fa -ctk $ct -ctv $ct \
    > $O/llama-b4x16k-pps-q8-fa-$fa-$ct.txt 2>&1
done
for fa in off on; do
  stamp llama-q8-b1x32k-fa-$fa
  $B/llama-batched-bench -m $Q8 -c 32256 -b 2048 -ub 512 -npp 32000 -ntg 16 -npl 1 -t 2 -fa $fa > $O/llama-b1x32k-q8-fa-$fa.txt 2>&1
done
stamp end
date -u > $O/end.txt
