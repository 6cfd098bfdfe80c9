#!/usr/bin/env bash
# llama.cpp on the same machine, same GGUF, same thread count: the reference a CPU user would pick.
# A reference, not a dependency: builds llama.cpp from the source inside the llama-cpp-python sdist (PyPI),
# then measures decode tok/s at batch 1 for context depths 1k/4k/8k (llama-bench -d), its max RSS at batch 1 x 4k,
# and batches 4 and 8 over distinct prompts at 4k (llama-batched-bench; BATCH_DEPTHS for others), with a GGUF as
# given (default: the default model's, Q4_1) and F16 and Q8_0 copies of it.
#
#   bash scripts/llama_cpp_bench.sh [OUT_DIR=results/llamacpp] [THREADS=2] [MODEL.gguf]
#   WEIGHTS="F16 Q8_0" BATCHED=0 bash scripts/llama_cpp_bench.sh ...   # the F16 and Q8_0 copies, batch 1 only
#   WEIGHTS="F16" BATCH1=0 bash scripts/llama_cpp_bench.sh ...         # the F16 copy only, batches only
#   DEPTHS=4096,16384 ...                                              # batch 1 at these depths
#   PREFILL=16,4096 ...                                                # prompt tokens/s at these lengths too
#   BATCH_DEPTHS="4096 8192" BATCH_SETTINGS="off:f16 on:q8_0" ...       # batches at these prompt lengths, settings
#
# Each cell with flash attention off and on (KV F16) and on with KV q8_0, batches too: report llama.cpp's best per cell.
# Needs cmake and a C++ compiler. Takes ~10 minutes to build on 2 cores, ~6 minutes per weight type at batch 1,
# and far longer for the batches (distinct prompts: 16k and 32k prompt tokens per setting).
set -euo pipefail
OUT=${1:-results/llamacpp}
THREADS=${2:-2}
PY=${PYTHON:-.venv/bin/python}
WORK=${LLAMA_WORK:-$HOME/.cache/infinigen_kv/llama.cpp}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
WEIGHTS=${WEIGHTS:-"GGUF F16"}  # GGUF: the file as given
DEPTHS=${DEPTHS:-1024,4096,8192}
REPS=${REPS:-3}  # repetitions of each llama-bench cell
BATCHED=${BATCHED:-1}
PREFILL=${PREFILL:-}  # prompt lengths for prompt-processing tokens/s (llama-bench -p), none by default
BATCH1=${BATCH1:-1}
BATCH_DEPTHS=${BATCH_DEPTHS:-4096}                     # prompt tokens per sequence in the batches
BATCH_SETTINGS=${BATCH_SETTINGS:-"off:f16 on:f16 on:q8_0"}  # flash attention : KV type
mkdir -p "$OUT" "$WORK"
OUT=$(cd "$OUT" && pwd)

SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -d "$SRC" ]; then
  "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK" -q
  tar xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
fi
BUILD="$SRC/build"
if [ ! -x "$BUILD/bin/llama-batched-bench" ]; then
  cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >"$OUT/cmake.log" 2>&1
  cmake --build "$BUILD" -j "$(nproc)" --target llama-bench llama-batched-bench llama-quantize >"$OUT/build.log" 2>&1
fi
BIN="$BUILD/bin"

SRC_GGUF=${3:-$("$PY" -c "from infinigen_kv.model.load import default_gguf; print(default_gguf())")}
copy() {  # the source GGUF requantized to type $1, once
  local f="$WORK/$(basename "${SRC_GGUF%.gguf}").$1.gguf"
  [ -f "$f" ] || "$BIN/llama-quantize" --allow-requantize "$SRC_GGUF" "$f" "$1" >"$OUT/quantize-$1.log" 2>&1
  echo "$f"
}

{
  echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores, threads $THREADS"
  echo "isa: $(grep -m1 -o -w 'avx2\|avx512f\|avx512_bf16\|avx512_vnni\|amx_tile' /proc/cpuinfo | sort -u | xargs)"
  echo "llama.cpp: from llama-cpp-python $VERSION ($(cd "$SRC" && git describe --tags 2>/dev/null || echo vendored))"
} >"$OUT/machine.txt"
cat "$OUT/machine.txt"

echo "model: $SRC_GGUF" >>"$OUT/machine.txt"
for name in $WEIGHTS; do
  if [ "$name" = GGUF ]; then model=$SRC_GGUF; else model=$(copy "$name"); fi
  if [ "$BATCH1" = 1 ]; then
    echo "== $name: batch 1, 32 new tokens at depths $DEPTHS (llama-bench), flash attention off/on, KV F16; on with KV q8_0"
    "$BIN/llama-bench" -m "$model" -t "$THREADS" -p 0 -n 32 -d "$DEPTHS" -r "$REPS" -fa off,on -o md | tee "$OUT/bench-$name.md"
    "$BIN/llama-bench" -m "$model" -t "$THREADS" -p 0 -n 32 -d "$DEPTHS" -r "$REPS" -fa on -ctk q8_0 -ctv q8_0 -o md \
      | tee "$OUT/bench-$name-q8kv.md"
    # max RSS of one batch-1 run at depth 4k (flash attention on, KV F16): the process's peak, weights included
    /usr/bin/time -f "max RSS %M KB" "$BIN/llama-bench" -m "$model" -t "$THREADS" -p 0 -n 32 -d 4096 -r 1 -fa on \
      -o md >/dev/null 2>"$OUT/rss-$name.txt" || true
    tail -1 "$OUT/rss-$name.txt"
  fi
  if [ -n "$PREFILL" ]; then
    echo "== $name: prompt processing of $PREFILL tokens (llama-bench -p), flash attention off/on, KV F16"
    "$BIN/llama-bench" -m "$model" -t "$THREADS" -p "$PREFILL" -n 0 -r "$REPS" -fa off,on -o md | tee "$OUT/prefill-$name.md"
  fi
  [ "$BATCHED" = 1 ] || continue
  # Distinct prompts (no -pps): every sequence has its own cells, as a batch of different requests has; a shared
  # prompt (-pps) would let llama.cpp read one copy of the KV for all of them. Its prefill of 4 x and 8 x the prompt
  # length takes minutes on 2 cores.
  for depth in $BATCH_DEPTHS; do
    for setting in $BATCH_SETTINGS; do
      fa=${setting%%:*}; ct=${setting#*:}
      tag="batched-$name-fa$fa-$ct"; [ "$depth" = 4096 ] || tag="$tag-n$depth"
      echo "== $name: batch 4 and 8 x $depth-token distinct prompts, 32 new tokens each (llama-batched-bench), -fa $fa, KV $ct"
      "$BIN/llama-batched-bench" -m "$model" -t "$THREADS" -c $((depth * 8 + 4000)) -b 2048 -ub 512 -npp "$depth" \
        -ntg 32 -npl 4,8 -fa "$fa" -ctk "$ct" -ctv "$ct" 2>"$OUT/$tag.log" | tee "$OUT/$tag.md"
    done
  done
done
