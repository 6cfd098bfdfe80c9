#!/usr/bin/env bash
O=${1:?usage: $0 OUT_DIR}; mkdir -p "$O"; O=$(cd "$O" && pwd)
M=$(realpath "${QWEN:?set QWEN to the Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF}") || exit 2
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"  # the clone this script is in
echo "profile $(date -u +%H:%M:%S)" >> $O/times.txt
.venv/bin/python scripts/dev/profile_decode.py --model $M --batch 1 --prompt-len 32000 --steps 8 --cprofile 30 > $O/profile_b1_32k.txt 2>&1
echo "end3 $(date -u +%H:%M:%S)" >> $O/times.txt
