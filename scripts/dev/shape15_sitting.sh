#!/usr/bin/env bash
# One sitting on Qwen2.5-1.5B's shape with random weights (scripts/dev/random_gguf.py; llama-quantize made its Q4_K_M
# and Q8_0 copies): decode at B1 x 4k, ours (options_ab: full and infinigen alternated in one process) in bfloat16 and
# int8 rows from the F16 GGUF and int4 rows from the Q4_K_M GGUF, against llama.cpp on each same file (2 threads,
# flash attention off and on); then B4 x 4k in int4 against Q4_K_M.
O=${1:?out dir}; mkdir -p $O
S=~/.cache/infinigen_kv/llama.cpp/shape15
B=~/.cache/infinigen_kv/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin
PY=${PY:-/work/main/.venv/bin/python}
stamp() { echo "$1 $(date -u +%H:%M:%S)" >> $O/times.txt; }
date -u > $O/start.txt; lscpu | grep -E "Model name" >> $O/start.txt
grep -o -w -E "avx512_bf16|avx512_vnni|amx_bf16|avx2" /proc/cpuinfo | sort -u | tr '\n' ' ' >> $O/start.txt
git log --oneline | head -1 >> $O/start.txt
stamp ours-f16-b1x4k
$PY scripts/dev/options_ab.py --model $S/qwen2.5-1.5b-shape-f16.gguf --batch 1 --prompt-len 4096 --steps 24 \
  --configs full,infinigen,full:weights=int8,infinigen:weights=int8 > $O/ours-bf16-int8-b1x4k.txt 2>&1
stamp ours-q4-b1x4k
$PY scripts/dev/options_ab.py --model $S/qwen2.5-1.5b-shape-q4_k_m.gguf --batch 1 --prompt-len 4096 --steps 24 \
  --configs full:weights=int4,infinigen:weights=int4 > $O/ours-int4-b1x4k.txt 2>&1
for q in q4_k_m q8_0 f16; do
  stamp llama-$q-b1x4k
  $B/llama-bench -m $S/qwen2.5-1.5b-shape-$q.gguf -p 0 -n 32 -d 4096 -fa 0,1 -t 2 -r 1 > $O/llama-bench-$q.txt 2>&1
done
stamp ours-q4-b4x4k
$PY scripts/dev/options_ab.py --model $S/qwen2.5-1.5b-shape-q4_k_m.gguf --batch 4 --prompt-len 4096 --steps 16 \
  --configs full:weights=int4,infinigen:weights=int4 > $O/ours-int4-b4x4k.txt 2>&1
for fa in off on; do
  stamp llama-q4_k_m-b4x4k-fa-$fa
  $B/llama-batched-bench -m $S/qwen2.5-1.5b-shape-q4_k_m.gguf -c 16640 -b 2048 -ub 512 -npp 4096 -ntg 32 -npl 4 -pps \
    -t 2 -fa $fa > $O/llama-b4x4k-q4_k_m-fa-$fa.txt 2>&1
done
stamp end
