#!/usr/bin/env bash
# Decode at B1 x 4k, two weight settings of one model alternated (A B A B), each a fresh `bench speed` process
# (full and infinigen interleaved in it): the default weights against another.
#
#   bash decode_ab.sh OUT MODEL WEIGHTS_B      (WEIGHTS_B: int4, bfloat16, ...; A is the default)
set -euo pipefail
OUT=${1:?usage: bash decode_ab.sh OUT MODEL WEIGHTS_B}; M=${2:?usage: bash decode_ab.sh OUT MODEL WEIGHTS_B}
B=${3:?usage: bash decode_ab.sh OUT MODEL WEIGHTS_B}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
name=$(basename "$M" .gguf)
for round in 1 2; do
  for w in auto "$B"; do
    "$PY" -m infinigen_kv.cli bench speed --model "$M" --weights "$w" --methods full,infinigen --batch 1 \
      --prompt-len 4096 --new-tokens 32 --repeats 3 --json > "$OUT/$name.$w.$round.json" 2> "$OUT/$name.$w.$round.err"
    "$PY" -c "import json,sys; r=json.load(open(sys.argv[1]))['rows']; print(sys.argv[2], sys.argv[3], sys.argv[4], \
      ', '.join(f\"{x['method']} {x['decode_tokens_per_s']:.2f} tok/s\" for x in r))" \
      "$OUT/$name.$w.$round.json" "$name" "$w" "$round"
  done
done
