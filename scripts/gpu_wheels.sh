#!/usr/bin/env bash
# Wheels the GPU machine lacks (it has torch, an older transformers, no server packages, no internet), into .whl/ (git-ignored;
# it travels with the working tree: name it in the device tool's `carry`). Run here, where pip reaches PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl transformers==5.23.0 gguf==0.19.0 \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing_extensions==4.16.0 opentelemetry-api==1.45.2  # gpu_check's serve step: the server's
  # packages (fastapi >= 0.160 imports opentelemetry-api, which the GPU image lacks)
du -sh .whl
