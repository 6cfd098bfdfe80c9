"""H2O's prefill scores (the column sums of a prompt chunk's attention probabilities) over a long past: PyTorch's
float32 path against the CPU kernel in bfloat16 products (kernels/prefill.cpp, `prefill_column_sums`), one chunk of
512 queries at the end of a past of n keys, at Gemma 3 270M's global layers' shape (4 query heads, 1 KV head of 256)
and Qwen2.5-0.5B's (14 / 2 of 64); best of --repeats, and the largest difference against the float32 sums.

    python scripts/dev/h2o_prefill_scores.py [--lengths 8192,16384,32768] [--repeats 3]
"""

import argparse
import time
from types import SimpleNamespace

import torch

from infinigen_kv.methods import h2o
from infinigen_kv.model import backend

SHAPES = {"gemma3-270m": (4, 1, 256), "qwen2.5-0.5b": (14, 2, 64)}  # query heads, KV heads, head dim


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="8192,16384,32768")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    BACKEND = backend.build("cpu")
    torch.manual_seed(0)
    T, long_past = args.chunk, h2o.LONG_PAST
    for name, (H, G, d) in SHAPES.items():
        for n in map(int, args.lengths.split(",")):
            q, k = torch.randn(1, H, T, d), torch.randn(1, G, n, d).bfloat16()
            sums = {}

            def run(kernel: bool):
                h2o.LONG_PAST = long_past if kernel else n  # the float32 path where the past is "short"
                layer = h2o.H2OLayer.__new__(h2o.H2OLayer)
                layer.window, layer.score = None, SimpleNamespace(data=torch.zeros(1, G, n, 1))
                layer.add_prefill_scores(q, k, None, d**-0.5, BACKEND)
                sums[kernel] = layer.score.data[0, :, :, 0]

            slow, fast = best(lambda: run(False), args.repeats), best(lambda: run(True), args.repeats)
            diff = (sums[True] - sums[False]).abs().max().item()
            print(f"{name}, chunk of {T} over {n} keys: float32 {slow * 1e3:.0f} ms, kernel {fast * 1e3:.0f} ms "
                  f"({slow / fast:.1f}x); largest difference {diff:.1e} (largest sum {sums[False].max().item():.2f})")


if __name__ == "__main__":
    main()
