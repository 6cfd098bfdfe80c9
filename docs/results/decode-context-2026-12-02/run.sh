#!/usr/bin/env bash
# Decode tokens/s against context at batch 1, one sitting: ours at the defaults (the GGUF at its own precision; full
# and infinigen alternated step by step in one process, options_ab) against llama.cpp on the same GGUF (llama-bench,
# flash attention off and on: the plot takes its better one per context).
#
#   QWEN=MODEL.gguf bash run.sh OUT_DIR [CONTEXTS]      CONTEXTS: comma-separated, default 1024,2048,4096,8192,16384
O=${1:?usage: QWEN=MODEL.gguf bash run.sh OUT_DIR [CONTEXTS]}; mkdir -p "$O"; O=$(cd "$O" && pwd)
M=$(realpath "${QWEN:?set QWEN to the Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF}") || exit 2
CONTEXTS=${2:-1024,2048,4096,8192,16384}
PY=${PY:-python}
B=${LLAMA_BIN:-~/.cache/infinigen_kv/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin}  # scripts/llama_cpp_bench.sh builds it
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"  # the clone this script is in
stamp() { echo "$1 $(date -u +%H:%M:%S)" >> $O/times.txt; }
{ date -u; lscpu | grep -E "Model name"; grep -o -w -E "avx512_bf16|avx512_vnni|amx_bf16|avx2" /proc/cpuinfo | sort -u | tr '\n' ' '
  echo; git log --oneline | head -1; } > $O/start.txt
for n in ${CONTEXTS//,/ }; do
  stamp ours-b1-$n
  $PY scripts/dev/options_ab.py --model "$M" --configs full,infinigen --batch 1 --prompt-len $n --steps 16 \
    > $O/options_ab_b1_$n.txt 2>&1
done
stamp llama-bench
$B/llama-bench -m "$M" -p 0 -n 32 -d $CONTEXTS -fa 0,1 -t 2 -r 1 > $O/llama-bench-b1.txt 2>&1
stamp end
