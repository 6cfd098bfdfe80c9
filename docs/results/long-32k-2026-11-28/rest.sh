#!/usr/bin/env bash
# After run3.sh, with the same OUT_DIR: the rest of the sitting, most needed first (then: the decode attention in
# bfloat16 dot products from 1,024 rows on top of the prefill kernel). BEFORE_SO / AFTER_SO: the two builds of the
# CPU kernels decode_ab.py compares (under ~/.cache/torch_extensions).
HERE=$(cd "$(dirname "$0")" && pwd)  # this sitting: its helper scripts
DATA=$(realpath "${DATA:?set DATA to the evaluation text folder (wikitext-2/, pg19/)}") || exit 2
O=${1:?usage: $0 OUT_DIR}; mkdir -p "$O"; O=$(cd "$O" && pwd)
M=$(realpath "${QWEN:?set QWEN to the Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF}") || exit 2
B=${LLAMA_BIN:-~/.cache/infinigen_kv/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin}  # scripts/llama_cpp_bench.sh builds it
F16=~/.cache/infinigen_kv/llama.cpp/qwen2.5-coder-0.5b-instruct-q4_k_m.F16.gguf
Q8=~/.cache/infinigen_kv/llama.cpp/qwen2.5-coder-0.5b-instruct-q4_k_m.Q8_0.gguf
PY=".venv/bin/python"
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"  # the clone this script is in
export PYTHONPATH=$PWD/src
stamp() { echo "$1 $(date -u +%H:%M:%S)" >> $O/times.txt; }
stamp decode-ab
$PY "$HERE/decode_ab.py" "${BEFORE_SO:?set BEFORE_SO to the kernels before}" "${AFTER_SO:?set AFTER_SO to the kernels after}" > $O/decode_ab.txt 2>&1
stamp options-b1x32k
$PY scripts/dev/options_ab.py --model $M --configs full,infinigen,offload --batch 1 --prompt-len 32000 --steps 16 > $O/options_ab_b1_32k.txt 2>&1
for fa in off on; do
  stamp llama-b4-pps-fa-$fa
  $B/llama-batched-bench -m $F16 -c 65792 -b 2048 -ub 512 -npp 16384 -ntg 16 -npl 4 -pps -t 2 -fa $fa > $O/llama-b4x16k-pps-f16-fa-$fa.txt 2>&1
done
stamp ppl
$PY scripts/dev/long_prefill_ppl.py --data $DATA/wikitext-2/test.txt --model $M --window 8192 --windows 2 > $O/long_prefill_ppl.txt 2>&1
stamp questions
$PY scripts/prefix_bench.py --data $DATA --model gemma3-270m --methods infinigen --scenarios questions --out $O/questions > $O/questions.txt 2>&1
stamp end-rest
