"""A decode step's linears alone on Qwen2.5-1.5B's shape (28 layers: merged qkv, o, merged gate_up, down; the LM head)
with random weights held as `fmt` (bfloat16, int8 or int4 rows), one row of activations, every weight read once a step
as a real step reads it (from DRAM, not a cache): each kind's time a step and its rate; medians over the steps.

    python scripts/dev/step_linears.py int8 8      # format, steps
"""

import statistics
import sys
import time

import torch

from infinigen_kv.model import ops

torch.manual_seed(0)
L, H, F, V = 28, 1536, 8960, 151936
shapes = {"qkv": (H + 512, H), "o": (H, H), "gate_up": (2 * F, H), "down": (H, F)}
fmt = sys.argv[1] if len(sys.argv) > 1 else "int8"
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 8
layers = [{k: ops.held(torch.randn(*s) * 0.02, fmt) for k, s in shapes.items()} for _ in range(L)]
head = ops.held(torch.randn(V, H) * 0.02, fmt)
nbytes = {k: layers[0][k].numel() * layers[0][k].element_size() * L for k in shapes}
nbytes["head"] = head.numel() * head.element_size()
x = torch.randn(1, H)
xf = torch.randn(1, F)
times = {k: [] for k in nbytes}
totals = []
for s in range(steps + 2):
    t = dict.fromkeys(nbytes, 0.0)
    t0 = time.perf_counter()
    for l in range(L):
        for k in shapes:
            a = time.perf_counter()
            ops.linear(xf if k == "down" else x, layers[l][k])
            t[k] += time.perf_counter() - a
    a = time.perf_counter()
    ops.linear(x, head, bf16=False)
    t["head"] += time.perf_counter() - a
    totals.append(time.perf_counter() - t0)
    if s >= 2:
        for k in t:
            times[k].append(t[k])
print(f"{fmt}: step's linears {statistics.median(totals[2:]) * 1e3:.2f} ms, "
      f"{sum(nbytes.values()) / 1e9:.3f} GB -> {sum(nbytes.values()) / statistics.median(totals[2:]) / 1e9:.1f} GB/s")
for k in nbytes:
    m = statistics.median(times[k])
    print(f"  {k:8s} {m * 1e3:7.2f} ms  {nbytes[k] / 1e6:8.1f} MB  {nbytes[k] / m / 1e9:5.1f} GB/s")
