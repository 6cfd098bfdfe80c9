#!/usr/bin/env bash
# First use of a model and a later one, as a new user meets them: `infinigen generate --prompt Hello
# --max-new-tokens 8` (default method and weights) with an empty cache, then twice more; each run's wall time and
# peak RSS (/usr/bin/time), its stderr, the cache's bytes on disk; then `--weights int4` (another held form: no
# calibration, no entry rebuilt).
#
#   bash first_use.sh OUT MODEL...     MODEL: default, or a .gguf path
#   PYTHONPATH=OLD/src bash first_use.sh OUT ...   # another checkout's code with the same venv
set -euo pipefail
OUT=${1:?usage: bash first_use.sh OUT MODEL...}; shift
[ $# -ge 1 ] || { echo "usage: bash first_use.sh OUT MODEL...  (MODEL: default, or a .gguf path)" >&2; exit 2; }
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
for M in "$@"; do
  name=$(basename "$M" .gguf)
  CACHE=$(mktemp -d)
  for run in first later later2 int4; do
    extra=(); [ "$run" = int4 ] && extra=(--weights int4)
    /usr/bin/time -f "%e s wall, %M KB max RSS" -o "$OUT/$name.$run.time" env INFINIGEN_CACHE_DIR="$CACHE" \
      "$PY" -m infinigen_kv.cli generate --model "$M" --prompt Hello --max-new-tokens 8 "${extra[@]}" \
      > "$OUT/$name.$run.out" 2> "$OUT/$name.$run.err"
    [ "$run" = first ] && du -sb "$CACHE"/* > "$OUT/$name.first.du"
    echo "$name $run: $(cat "$OUT/$name.$run.time")"
  done
  du -sb "$CACHE"/* > "$OUT/$name.du"
  rm -rf "$CACHE"
done
