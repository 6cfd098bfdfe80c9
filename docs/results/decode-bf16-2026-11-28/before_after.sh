#!/usr/bin/env bash
# Decode steps before (8dac0c1: float32 products in decode) and after (6eaa263: bfloat16 products), trees alternated;
# then the kernels alone (bench_kernels.py) on each tree.
HERE=$(cd "$(dirname "$0")" && pwd)  # this sitting: its helper scripts
PY=${PY:-python}
M=$(realpath "${QWEN:?set QWEN to the Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF}") || exit 2
O=${1:?usage: $0 OUT_DIR}; mkdir -p "$O"; O=$(cd "$O" && pwd)
for tree in "${BEFORE:?set BEFORE to a checkout of the code before}" "${AFTER:-$PWD}"; do
  for args in "--batch 1 --prompt-len 4096 --steps 24" "--batch 4 --prompt-len 4096 --steps 24" \
              "--model $M --batch 1 --prompt-len 4096 --steps 24" "--model $M --batch 4 --prompt-len 4096 --steps 16"; do
    echo "## $tree $args $(date -u +%H:%M:%S)" >> $O/before_after.txt
    PYTHONPATH=$tree/src $PY $tree/scripts/dev/options_ab.py --configs full,infinigen $args 2>&1 | grep "^| [fi]" >> $O/before_after.txt
  done
done
for tree in "$BEFORE" "${AFTER:-$PWD}"; do
  echo "## kernels $tree $(date -u +%H:%M:%S)" >> $O/kernels.txt
  PYTHONPATH=$tree/src $PY "$HERE/bench_kernels.py" >> $O/kernels.txt 2>&1
done
