#!/usr/bin/env bash
# The [hf] adapter's tests (tests/test_hf.py, tests/test_readme.py) and a GGUF conversion against the oldest and the
# newest transformers of the range pyproject.toml claims, each installed beside this checkout's .venv (no deps: the
# .venv's torch and tokenizers serve every version of the range) and put first on the path.
#
#   bash scripts/hf_range.sh [VERSIONS="5.18.0 5.24.0"]
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
VERSIONS=${1:-"5.18.0 5.24.0"}
for v in $VERSIONS; do
  dir=${TMPDIR:-/tmp}/transformers-$v
  [ -d "$dir/transformers" ] || "$PY" -m pip install -q --no-deps --target "$dir" "transformers==$v" httpx
  echo "== transformers $v"
  PYTHONPATH="$dir" "$PY" -m pytest -q -p no:cacheprovider tests/test_hf.py tests/test_readme.py
  PYTHONPATH="$dir" INFINIGEN_CACHE_DIR="$(mktemp -d)" "$PY" -c "
import transformers, infinigen_kv as ig
m, tok = ig.load_model()  # the default model's GGUF converted by this transformers
r = ig.generate(m, tok('The capital of France is', return_tensors='pt').input_ids, cache=ig.make_cache('full', m), max_new_tokens=4)
print('converted and generated with transformers', transformers.__version__, repr(tok.decode(r.tokens[0])))"
done
