#!/usr/bin/env bash
# ik_llama.cpp (the llama.cpp fork with its own CPU matrix and flash-attention kernels) on the same machine, same
# GGUF, same thread count: the fastest CPU engine a user would pick. A reference, not a dependency: this script
# measures a build the user made of its public repository (ikawrakow/ik_llama.cpp), given as the folder holding its
# llama-bench and llama-batched-bench, at the cells llama_cpp_bench.sh measures for mainline:
#   prompt tokens/s at PREFILL (llama-bench -p), decode tok/s after DEPTHS prompt tokens (-gp DEPTH,32), each over the
#   settings grid flash attention 0/1 x run-time repacking 0/1 x K/V f16 / q8_0 (report its best per cell);
#   batches of distinct prompts (llama-batched-bench, -npl BATCHES at BATCH_DEPTHS) at its best settings.
#
#   bash scripts/ik_llama_cpp_bench.sh BIN_DIR OUT_DIR MODEL.gguf [THREADS=2]
#   PREFILL=4096,16384,32768 DEPTHS=4096,16384,32768 REPS=3 BATCHES=4 BATCH_DEPTHS=4096 ...   (the defaults)
#   FA=0,1 RTR=0,1 KV="f16 q8_0" ...                                                         (the settings grid)
#
# An empty PREFILL, DEPTHS or BATCHES skips those cells. BIN_DIR: its build's bin folder, built for this machine's
# CPU (a Release build with its native kernels). A 32k prompt takes minutes a setting on 2 cores: the long cells cost
# most of the run.
set -euo pipefail
USAGE="usage: bash scripts/ik_llama_cpp_bench.sh BIN_DIR OUT_DIR MODEL.gguf [THREADS]"
[ $# -ge 3 ] || { echo "$USAGE" >&2; exit 2; }
BIN=$1 OUT=$2 MODEL=$3 THREADS=${4:-2}
for tool in llama-bench llama-batched-bench; do
  [ -x "$BIN/$tool" ] || { echo "$BIN holds no $tool: give the bin folder of an ik_llama.cpp build" >&2; exit 2; }
done
[ -f "$MODEL" ] || { echo "no GGUF at $MODEL" >&2; exit 2; }
PREFILL=${PREFILL-4096,16384,32768}
DEPTHS=${DEPTHS-4096,16384,32768}
REPS=${REPS:-3}
FA=${FA:-0,1} RTR=${RTR:-0,1} KV=${KV:-"f16 q8_0"}
BATCHES=${BATCHES-4} BATCH_DEPTHS=${BATCH_DEPTHS:-4096}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd) BIN=$(cd "$BIN" && pwd) MODEL=$(realpath "$MODEL")

{
  echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores, threads $THREADS"
  echo "isa: $(grep -o -w 'avx2\|avx512f\|avx512_bf16\|avx512_vnni\|amx_tile' /proc/cpuinfo | sort -u | xargs)"
  echo "ik_llama.cpp: $("$BIN/llama-bench" --version 2>&1 | grep -m1 -i 'version' || echo "version not printed")"
  echo "model: $MODEL"
} | tee "$OUT/machine.txt"

for kv in $KV; do
  kvargs=(-ctk "$kv" -ctv "$kv")
  if [ -n "$PREFILL" ]; then
    echo "== prompt processing of $PREFILL tokens, -fa $FA, -rtr $RTR, KV $kv"
    "$BIN/llama-bench" -m "$MODEL" -t "$THREADS" -p "$PREFILL" -n 0 -r "$REPS" -fa "$FA" -rtr "$RTR" "${kvargs[@]}" \
      -o md | tee "$OUT/prefill-$kv.md"
  fi
  gp=(); for d in ${DEPTHS//,/ }; do gp+=(-gp "$d,32"); done
  if [ ${#gp[@]} -gt 0 ]; then
    echo "== decode of 32 tokens after $DEPTHS prompt tokens, -fa $FA, -rtr $RTR, KV $kv"
    "$BIN/llama-bench" -m "$MODEL" -t "$THREADS" -p 0 -n 0 "${gp[@]}" -r "$REPS" -fa "$FA" -rtr "$RTR" \
      "${kvargs[@]}" -o md | tee "$OUT/decode-$kv.md"
  fi
done

# batches of distinct prompts (no -pps: each sequence its own cells, as different requests have), flash attention on,
# K/V f16, run-time repacking on (its usual best on CPU; a grid here would take hours at these lengths)
for depth in $BATCH_DEPTHS; do
  [ -n "$BATCHES" ] || break
  echo "== batches $BATCHES x $depth-token distinct prompts, 32 new tokens each, -fa 1 -rtr 1, KV f16"
  (cd "$OUT" && "$BIN/llama-batched-bench" -m "$MODEL" -t "$THREADS" -c $((depth * 8 + 4000)) -b 2048 -ub 512 -npp "$depth" \
    -ntg 32 -npl "$BATCHES" -fa 1 -rtr 2>"$OUT/batched-n$depth.log") | tee "$OUT/batched-n$depth.md"  # (its llama.log in OUT)
  grep -q '^|' "$OUT/batched-n$depth.md" || grep '^|' "$OUT/batched-n$depth.log" | tee "$OUT/batched-n$depth.md"  # (a build that logs its table)
done
