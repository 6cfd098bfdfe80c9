#!/usr/bin/env bash
# One sitting on the 0.5B at 16k, bf16 weights / llama.cpp F16: prefill tokens/s and peak RSS, decode B1 x 16k.
DOC=$(realpath "${DOC:?set DOC to the prompt file (the start of the WikiText-2 test text)}") || exit 2
M=$(realpath "${QWEN:?set QWEN to the Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF}") || exit 2
B=${LLAMA_BIN:-~/.cache/infinigen_kv/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin}  # scripts/llama_cpp_bench.sh builds it
F16=~/.cache/infinigen_kv/llama.cpp/qwen2.5-coder-0.5b-instruct-q4_k_m.F16.gguf
O=${1:?usage: $0 OUT_DIR}; mkdir -p "$O"; O=$(cd "$O" && pwd)
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"  # the clone this script is in
date -u > $O/start.txt
lscpu | grep -E "Model name" >> $O/start.txt
grep -o -w -E "avx512_bf16|avx512_vnni|amx_bf16|avx2" /proc/cpuinfo | sort -u | tr '\n' ' ' >> $O/start.txt
git log --oneline | head -1 >> $O/start.txt
for method in full infinigen; do
  /usr/bin/time -v .venv/bin/infinigen generate --model $M --prompt-file $DOC --max-new-tokens 16 --method $method > $O/generate-$method.out 2> $O/generate-$method.err
done
.venv/bin/python scripts/dev/options_ab.py --model $M --configs full,infinigen --batch 1 --prompt-len 16384 --steps 24 > $O/options_ab_b1_16k.txt 2>&1
$B/llama-batched-bench -m $F16 -c 16640 -b 2048 -ub 512 -npp 16384 -ntg 16 -npl 1 -t 2 -fa on > $O/llama-batched-f16-fa-on.txt 2>&1
date -u > $O/end.txt
