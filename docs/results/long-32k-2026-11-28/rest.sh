#!/usr/bin/env bash
# After run3: the rest of the sitting, most needed first. Our code from /work/dev (the decode attention in bfloat16
# dot products from 1,024 rows on top of /work/main's prefill kernel).
cd /work/main
while pgrep -f "/tmp/long32k/run3.sh" > /dev/null; do sleep 5; done
O=/tmp/long32k
M=$(../shared/models/qwen2.5-coder-0.5b.sh)
B=~/.cache/infinigen_kv/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin
F16=~/.cache/infinigen_kv/llama.cpp/qwen2.5-coder-0.5b-instruct-q4_k_m.F16.gguf
Q8=~/.cache/infinigen_kv/llama.cpp/qwen2.5-coder-0.5b-instruct-q4_k_m.Q8_0.gguf
X=~/.cache/torch_extensions/py311_cpu
PY=".venv/bin/python"
export PYTHONPATH=/work/dev/src
stamp() { echo "$1 $(date -u +%H:%M:%S)" >> $O/times.txt; }
stamp decode-ab
$PY /tmp/decode_ab.py $X/infinigen_cpu_c309389f38/infinigen_cpu_c309389f38.so $X/infinigen_cpu_428d3aba8a/infinigen_cpu_428d3aba8a.so > $O/decode_ab.txt 2>&1
stamp options-b1x32k
$PY /work/dev/scripts/dev/options_ab.py --model $M --configs full,infinigen,offload --batch 1 --prompt-len 32000 --steps 16 > $O/options_ab_b1_32k.txt 2>&1
for fa in off on; do
  stamp llama-b4-pps-fa-$fa
  $B/llama-batched-bench -m $F16 -c 65792 -b 2048 -ub 512 -npp 16384 -ntg 16 -npl 4 -pps -t 2 -fa $fa > $O/llama-b4x16k-pps-f16-fa-$fa.txt 2>&1
done
stamp ppl
$PY /work/dev/scripts/dev/long_prefill_ppl.py --data /work/shared/data/wikitext-2/test.txt --model $M --window 8192 --windows 2 > $O/long_prefill_ppl.txt 2>&1
stamp questions
$PY /work/dev/scripts/prefix_bench.py --data /work/shared/data --model gemma3-270m --methods infinigen --scenarios questions --out $O/questions > $O/questions.txt 2>&1
stamp end-rest
