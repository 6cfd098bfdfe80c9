#!/usr/bin/env bash
# After run.sh: infinigen's 32k generate again on the code with the prefill kernel (run.sh's first run predates it),
# and the kernel against PyTorch's attention alone.
cd /work/main
while pgrep -f /tmp/long32k/run.sh > /dev/null; do sleep 5; done
O=/tmp/long32k
M=$(../shared/models/qwen2.5-coder-0.5b.sh)
echo "generate-infinigen-2 $(date -u +%H:%M:%S)" >> $O/times.txt
/usr/bin/time -v .venv/bin/infinigen generate --model $M --prompt-file /tmp/doc32k.txt --max-new-tokens 16 --method infinigen > $O/generate-infinigen-2.out 2> $O/generate-infinigen-2.err
echo "kbench $(date -u +%H:%M:%S)" >> $O/times.txt
.venv/bin/python /tmp/kbench.py > $O/kbench.txt 2>&1
echo "end2 $(date -u +%H:%M:%S)" >> $O/times.txt
