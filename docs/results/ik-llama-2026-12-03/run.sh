#!/usr/bin/env bash
# Ours against ik_llama.cpp on one GGUF, one sitting, 2 threads: decode tok/s at B1 over CONTEXTS (full and infinigen
# at the defaults, alternated step by step in one process: options_ab), at B4 x 4k, and prompt tokens/s (bench speed's
# prefill), then ik_llama.cpp's same cells (scripts/ik_llama_cpp_bench.sh, its settings grid FA x RTR x KV).
#
#   bash run.sh IK_BIN_DIR MODEL.gguf OUT_DIR [CONTEXTS=4096,16384]
# IK_BIN_DIR: the bin folder of an ik_llama.cpp build made for this CPU (llama-bench, llama-batched-bench).
set -euo pipefail
USAGE="usage: bash run.sh IK_BIN_DIR MODEL.gguf OUT_DIR [CONTEXTS]"
IK=${1:?$USAGE} M=$(realpath "${2:?$USAGE}") O=${3:?$USAGE} CONTEXTS=${4:-4096,16384}
mkdir -p "$O"; O=$(cd "$O" && pwd); IK=$(cd "$IK" && pwd)
PY=${PY:-python}
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"  # the clone this script is in
stamp() { echo "$1 $(date -u +%H:%M:%S)" >> "$O/times.txt"; }
{ date -u; lscpu | grep -E "Model name"; grep -o -w -E "avx512_bf16|avx512_vnni|amx_bf16|avx2" /proc/cpuinfo | sort -u | tr '\n' ' '
  echo; git log -1 --oneline; } > "$O/start.txt"
for n in ${CONTEXTS//,/ }; do
  stamp ours-b1-$n
  $PY scripts/dev/options_ab.py --model "$M" --configs full,infinigen --batch 1 --prompt-len "$n" --steps 16 \
    > "$O/ours-b1-$n.txt" 2>&1
  stamp ours-prefill-$n
  infinigen bench speed --model "$M" --methods full --batch 1 --prompt-len "$n" --new-tokens 2 --repeats 2 \
    > "$O/ours-prefill-$n.txt" 2>&1
done
stamp ours-b4-4096
$PY scripts/dev/options_ab.py --model "$M" --configs full,infinigen --batch 4 --prompt-len 4096 --steps 12 \
  > "$O/ours-b4-4096.txt" 2>&1
stamp ik
PREFILL=$CONTEXTS DEPTHS=$CONTEXTS REPS=1 BATCH_DEPTHS=4096 bash scripts/ik_llama_cpp_bench.sh "$IK" "$O/ik" "$M" 2 \
  > "$O/ik.log" 2>&1
stamp end
