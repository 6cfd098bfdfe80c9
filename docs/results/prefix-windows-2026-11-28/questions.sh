#!/usr/bin/env bash
cd /work/main
mkdir -p /work/runs/questions
date -u > /work/runs/questions/start.txt; git log --oneline | head -1 >> /work/runs/questions/start.txt
.venv/bin/python scripts/prefix_bench.py --data /work/shared/data --model gemma3-270m --methods infinigen \
  --scenarios questions --out /work/runs/questions/out > /work/runs/questions/questions.txt 2>&1
date -u > /work/runs/questions/end.txt
