#!/usr/bin/env bash
cd /work/main
while pgrep -f "/tmp/long32k/run2.sh" > /dev/null; do sleep 5; done
O=/tmp/long32k
M=$(../shared/models/qwen2.5-coder-0.5b.sh)
echo "profile $(date -u +%H:%M:%S)" >> $O/times.txt
PYTHONPATH=/work/dev/src .venv/bin/python /work/dev/scripts/dev/profile_decode.py --model $M --batch 1 --prompt-len 32000 --steps 8 --cprofile 30 > $O/profile_b1_32k.txt 2>&1
echo "end3 $(date -u +%H:%M:%S)" >> $O/times.txt
