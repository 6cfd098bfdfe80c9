#!/usr/bin/env bash
# Decode steps before (8dac0c1: float32 products in decode) and after (6eaa263: bfloat16 products), trees alternated;
# then the kernels alone (bench_kernels.py) on each tree.
M=$(bash /work/shared/models/qwen2.5-coder-0.5b.sh)
O=/work/runs/sit1
for tree in /work/ruler /work/main; do
  for args in "--batch 1 --prompt-len 4096 --steps 24" "--batch 4 --prompt-len 4096 --steps 24" \
              "--model $M --batch 1 --prompt-len 4096 --steps 24" "--model $M --batch 4 --prompt-len 4096 --steps 16"; do
    echo "## $tree $args $(date -u +%H:%M:%S)" >> $O/before_after.txt
    PYTHONPATH=$tree/src /work/main/.venv/bin/python $tree/scripts/dev/options_ab.py --configs full,infinigen $args 2>&1 | grep "^| [fi]" >> $O/before_after.txt
  done
done
for tree in /work/ruler /work/main; do
  echo "## kernels $tree $(date -u +%H:%M:%S)" >> $O/kernels.txt
  PYTHONPATH=$tree/src /work/main/.venv/bin/python $O/bench_kernels.py >> $O/kernels.txt 2>&1
done
