"""Decode steps of the 0.5B with int4 weights, the linears' int4 weights in tiles (this tree) or in rows (HEAD's
kernel, built aside), alternated step by step in one process; full and infinigen each."""
import statistics, sys, time
from pathlib import Path
import torch
from torch.utils.cpp_extension import load
import infinigen_kv as ig
from infinigen_kv.model import int4_rows, ops
from infinigen_kv.model.kernels import _FLAGS
from infinigen_kv.bench.speed import prompts
from infinigen_kv.bench.tee import TeeCache
from infinigen_kv.runtime.generation import prefill

torch.set_grad_enabled(False)
M, B, n, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
old_dir = Path(sys.argv[5])  # the parent commit's src/infinigen_kv/model/kernels (git show d555db1:...)
old = load(name="ig_old_rows_b", sources=[str(old_dir / "cpu.cpp"), str(old_dir / "prefill.cpp")], extra_cflags=_FLAGS,
           extra_ldflags=["-fopenmp"], verbose=False)
new = ops.cpu_kernels()
model, tok = ig.load_model(M, weights="int4")
params = [p for p in model.parameters() if p.dtype == torch.uint8]
tiles = [p.data for p in params]
rows = [int4_rows.rows_of(p.data) for p in params]
ids, mask = prompts(tok, B, n)
caches = {m: ig.make_cache(m, model) for m in ("full", "infinigen")}
for c in caches.values():
    c.reserve(n + 2 * steps + 4)
prefill(model, ids, mask, TeeCache(list(caches.values())), 2 * steps + 4)
pos = n
def setup(kind):
    ops._CPU[0] = new if kind == "tiles" else old
    for p, t in zip(params, tiles if kind == "tiles" else rows):
        p.data = t
times = {(m, k): [] for m in caches for k in ("tiles", "rows")}
x = torch.full((B,), 100)
for c in caches.values():  # a warm-up step each
    setup("tiles"); model.decode(c, x, torch.full((B, 1), pos), None)
pos += 1
for s in range(steps):
    for (m, k) in times:
        setup(k)
        t = time.perf_counter()
        model.decode(caches[m], x, torch.full((B, 1), pos), None)
        times[(m, k)].append(time.perf_counter() - t)
    pos += 1
setup("tiles")
base = statistics.median(times[("full", "rows")])
print(f"B={B} n={n}, median of {steps} steps alternated")
for key, ts in times.items():
    med = statistics.median(ts)
    print(f"{key[0]:10s} {key[1]:6s} {med * 1e3:7.2f} ms  {B / med:6.1f} tok/s  {med / base:.3f}x full-rows")
