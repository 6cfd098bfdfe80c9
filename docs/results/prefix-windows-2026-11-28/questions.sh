#!/usr/bin/env bash
O=${1:?usage: $0 OUT_DIR}; mkdir -p "$O"; O=$(cd "$O" && pwd)
DATA=$(realpath "${DATA:?set DATA to the evaluation text folder (wikitext-2/, pg19/)}") || exit 2
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"  # the clone this script is in
date -u > $O/start.txt; git log --oneline | head -1 >> $O/start.txt
.venv/bin/python scripts/prefix_bench.py --data $DATA --model gemma3-270m --methods infinigen \
  --scenarios questions --out $O/out > $O/questions.txt 2>&1
date -u > $O/end.txt
