#!/usr/bin/env bash
# After run.sh: infinigen's 32k generate again on the code with the prefill kernel (run.sh's first run predates it),
# and the kernel against PyTorch's attention alone.
HERE=$(cd "$(dirname "$0")" && pwd)  # this sitting: its helper scripts
DOC=$(realpath "${DOC:?set DOC to the prompt file (the start of the WikiText-2 test text)}") || exit 2
O=${1:?usage: $0 OUT_DIR}; mkdir -p "$O"; O=$(cd "$O" && pwd)
M=$(realpath "${QWEN:?set QWEN to the Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF}") || exit 2
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"  # the clone this script is in
echo "generate-infinigen-2 $(date -u +%H:%M:%S)" >> $O/times.txt
/usr/bin/time -v .venv/bin/infinigen generate --model $M --prompt-file $DOC --max-new-tokens 16 --method infinigen > $O/generate-infinigen-2.out 2> $O/generate-infinigen-2.err
echo "kbench $(date -u +%H:%M:%S)" >> $O/times.txt
.venv/bin/python "$HERE/kbench.py" > $O/kbench.txt 2>&1
echo "end2 $(date -u +%H:%M:%S)" >> $O/times.txt
