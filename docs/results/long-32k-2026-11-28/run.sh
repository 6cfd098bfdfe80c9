#!/usr/bin/env bash
# One sitting on the 0.5B at 32k (B1) and 16k (B4), bf16 weights / llama.cpp F16, plus Gemma 3 270M at 32k:
# prefill tokens/s, decode tokens/s, max RSS; llama.cpp's flash attention off / on and q8_0 K/V.
DOC=$(realpath "${DOC:?set DOC to the prompt file (the start of the WikiText-2 test text)}") || exit 2
M=$(realpath "${QWEN:?set QWEN to the Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF}") || exit 2
B=${LLAMA_BIN:-~/.cache/infinigen_kv/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin}  # scripts/llama_cpp_bench.sh builds it
F16=~/.cache/infinigen_kv/llama.cpp/qwen2.5-coder-0.5b-instruct-q4_k_m.F16.gguf
O=${1:?usage: $0 OUT_DIR}; mkdir -p "$O"; O=$(cd "$O" && pwd)
IG=.venv/bin/infinigen
T="/usr/bin/time -v"
stamp() { echo "$1 $(date -u +%H:%M:%S)" >> $O/times.txt; }
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"  # the clone this script is in
date -u > $O/start.txt
lscpu | grep -E "Model name" >> $O/start.txt
grep -o -w -E "avx512_bf16|avx512_vnni|amx_bf16|avx2" /proc/cpuinfo | sort -u | tr '\n' ' ' >> $O/start.txt
git log --oneline | head -1 >> $O/start.txt
for method in infinigen full; do
  stamp generate-$method
  $T $IG generate --model $M --prompt-file $DOC --max-new-tokens 16 --method $method > $O/generate-$method.out 2> $O/generate-$method.err
done
stamp llama-b1-fa-off
$B/llama-batched-bench -m $F16 -c 32256 -b 2048 -ub 512 -npp 32000 -ntg 16 -npl 1 -t 2 -fa off > $O/llama-b1x32k-f16-fa-off.txt 2>&1
stamp llama-b1-fa-on
$B/llama-batched-bench -m $F16 -c 32256 -b 2048 -ub 512 -npp 32000 -ntg 16 -npl 1 -t 2 -fa on > $O/llama-b1x32k-f16-fa-on.txt 2>&1
stamp options-b4x16k
.venv/bin/python scripts/dev/options_ab.py --model $M --configs full,infinigen,offload --batch 4 --prompt-len 16384 --steps 16 > $O/options_ab_b4_16k.txt 2>&1
for fa in off on; do
  stamp llama-b4-fa-$fa
  $B/llama-batched-bench -m $F16 -c 16640 -b 2048 -ub 512 -npp 16384 -ntg 16 -npl 4 -pps -t 2 -fa $fa > $O/llama-b4x16k-pps-f16-fa-$fa.txt 2>&1
done
for method in infinigen full; do
  stamp gemma-$method
  $T $IG generate --model gemma3-270m --prompt-file $DOC --max-new-tokens 16 --method $method > $O/gemma-generate-$method.out 2> $O/gemma-generate-$method.err
done
stamp llama-b1-q8
$B/llama-batched-bench -m $F16 -c 32256 -b 2048 -ub 512 -npp 32000 -ntg 16 -npl 1 -t 2 -fa on -ctk q8_0 -ctv q8_0 > $O/llama-b1x32k-f16-fa-on-q8kv.txt 2>&1
stamp end
date -u > $O/end.txt
