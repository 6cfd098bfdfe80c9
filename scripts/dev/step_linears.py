"""A decode step's linears alone on a Qwen2.5 shape (0.5B: 24 layers, 1.5B: 28; merged qkv, o, merged gate_up, down;
the LM head) with random weights held as `--weights` (bfloat16, int8 or int4 rows), `--rows` rows of activations,
every weight read once a step as a real step reads it (from DRAM, not a cache): each kind's time a step and its rate;
medians over the steps.

    python scripts/dev/step_linears.py --weights int4 --shape 0.5b --rows 4 --steps 8
"""

import argparse
import statistics
import time

import torch

from infinigen_kv.model import backend, ops

SHAPES = {"0.5b": (24, 896, 128, 4864), "1.5b": (28, 1536, 256, 8960)}  # layers, hidden, K+V out, intermediate
ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--weights", default="int8")
ap.add_argument("--shape", default="1.5b", choices=SHAPES)
ap.add_argument("--rows", type=int, default=1)
ap.add_argument("--steps", type=int, default=8)
args = ap.parse_args()
torch.manual_seed(0)
L, H, KV, F = SHAPES[args.shape]
V = 151936
shapes = {"qkv": (H + 2 * KV, H), "o": (H, H), "gate_up": (2 * F, H), "down": (H, F)}
layers = [{k: ops.held(torch.randn(*s) * 0.02, args.weights) for k, s in shapes.items()} for _ in range(L)]
head = ops.held(torch.randn(V, H) * 0.02, args.weights)
nbytes = {k: layers[0][k].numel() * layers[0][k].element_size() * L for k in shapes}
nbytes["head"] = head.numel() * head.element_size()
x = torch.randn(args.rows, H)
xf = torch.randn(args.rows, F)
BACKEND = backend.build("cpu")  # the machine's kernels and products
times = {k: [] for k in nbytes}
totals = []
for s in range(args.steps + 2):
    t = dict.fromkeys(nbytes, 0.0)
    t0 = time.perf_counter()
    for l in range(L):
        for k in shapes:
            a = time.perf_counter()
            ops.linear(xf if k == "down" else x, layers[l][k], None, BACKEND)
            t[k] += time.perf_counter() - a
    a = time.perf_counter()
    ops.linear(x, head, None, BACKEND, bf16=False)
    t["head"] += time.perf_counter() - a
    totals.append(time.perf_counter() - t0)
    if s >= 2:
        for k in t:
            times[k].append(t[k])
step = statistics.median(totals[2:])
total = sum(nbytes.values())
print(f"{args.weights} {args.shape} x {args.rows} rows: step's linears {step * 1e3:.2f} ms, {total / 1e9:.3f} GB -> "
      f"{total / step / 1e9:.1f} GB/s")
for k in nbytes:
    m = statistics.median(times[k])
    print(f"  {k:8s} {m * 1e3:7.2f} ms  {nbytes[k] / 1e6:8.1f} MB  {nbytes[k] / m / 1e9:5.1f} GB/s")
