#!/usr/bin/env bash
# The same answer on a busy machine: `infinigen generate` at the defaults (16 greedy tokens, --json) on a prompt cut
# from a text to N tokens, first on the quiet machine, then with an empty kernel-build folder's measurements gone
# and busy loops on every core (the thread tuner then runs the steps on fewer threads), then with a timing of 45.56
# ns written by hand where the code before kept its measurement; the tokens and fetched fraction of each.
#
#   bash same_answer.sh OUT TEXT MODEL:TOKENS...     e.g. default:2000 default:4900 QWEN.gguf:4000
set -euo pipefail
OUT=${1:?usage: bash same_answer.sh OUT TEXT MODEL:TOKENS...}; TEXT=${2:?usage: bash same_answer.sh OUT TEXT MODEL:TOKENS...}
shift 2
[ $# -ge 1 ] || { echo "usage: bash same_answer.sh OUT TEXT MODEL:TOKENS..." >&2; exit 2; }
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
cores=$(nproc)
for spec in "$@"; do
  M=${spec%:*}; N=${spec##*:}
  name=$(basename "$M" .gguf)-$N
  "$PY" - "$M" "$N" "$TEXT" "$OUT/$name.prompt.txt" <<'PY'
import sys
from infinigen_kv.model.load import load_model
_, tok = load_model(sys.argv[1])
ids = tok(open(sys.argv[3], encoding="utf-8").read())["input_ids"][: int(sys.argv[2])]
open(sys.argv[4], "w", encoding="utf-8").write(tok.decode(ids))
PY
  run() {  # $1: label
    "$PY" -m infinigen_kv.cli generate --model "$M" --prompt-file "$OUT/$name.prompt.txt" --max-new-tokens 16 --json \
      > "$OUT/$name.$1.json" 2> "$OUT/$name.$1.err"
    "$PY" -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], sys.argv[3], r['prompt_tokens'], \
      'tokens, fetched', r['fetched_fraction'], repr(r['text']))" "$OUT/$name.$1.json" "$name" "$1"
  }
  run quiet
  root=$("$PY" -c "from infinigen_kv.model import kernels; print(kernels._build_root() / ('infinigen_cpu_' + kernels._cpu_key()))")
  rm -f "$root"/attend_head_ns_t* "$root"/attend_pairs_upto
  pids=(); for _ in $(seq "$cores"); do "$PY" -c "while True: pass" & pids+=($!); done
  run busy
  kill "${pids[@]}"; wait "${pids[@]}" 2>/dev/null || true
  for t in 1 2 3 4; do echo 45.5600 > "$root/attend_head_ns_t$t"; done
  run planted
  rm -f "$root"/attend_head_ns_t*
done
