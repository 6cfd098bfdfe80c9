#!/usr/bin/env bash
# The GPU check in one command, from the repository root: writes results under $OUT (default results/gpu-check).
#   scripts/gpu_check.sh            on a machine with a CUDA GPU (the bare GPU machine: see docs/gpu.md)
#   scripts/gpu_check.sh --dry-run  every step on CPU at tiny sizes (what tests/test_gpu_check.py runs)
# A machine without internet gets what it lacks from wheels in .whl/ (scripts/gpu_wheels.sh fetches them here).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && ! "$PY" -c "import transformers, sys; sys.exit(transformers.__version__ != '5.23.0')" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/infinigen-site .whl/*.whl
  export PYTHONPATH=/tmp/infinigen-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-results/gpu-check}
mkdir -p "$OUT"
set -o pipefail
"$PY" scripts/gpu_check.py --out "$OUT" "$@" 2> >(tee "$OUT/gpu_check.log" >&2) | tee "$OUT/summary.md"
