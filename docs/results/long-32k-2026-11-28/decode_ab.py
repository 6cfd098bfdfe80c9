"""Decode attention over a whole bfloat16 past: the kernel before (float32 products) and after (bfloat16 dot products
from 1,024 rows), the same inputs, alternated."""
import importlib.util, sys, time, glob, torch
torch.set_grad_enabled(False)
def module(path):
    name = path.split("/")[-1][:-3]
    spec = importlib.util.spec_from_file_location(name, path); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
old, new = module(sys.argv[1]), module(sys.argv[2])
def t(f, n=20):
    f(); s = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - s) / n
for n in (4096, 16384, 32000):
    for B in (1, 4):
        G, r, d = 2, 7, 64
        q = torch.randn(B, G, r, d); Kp = torch.randn(B, G, n + 64, d).bfloat16(); Vp = torch.randn(B, G, n + 64, d).bfloat16()
        args = (q, Kp, Vp, None, None, None, -1, None, n, 0.125, torch.float32)
        a, b = t(lambda: old.attend(*args)), t(lambda: new.attend(*args))
        a2, b2 = t(lambda: old.attend(*args)), t(lambda: new.attend(*args))
        err = (old.attend(*args) - new.attend(*args)).abs().max().item()
        gb = 2 * B * G * n * d * 2 / 1e9
        print(f"B{B} x {n}, one layer (G={G}, r={r}, d={d}): float32 products {min(a,a2)*1e3:.2f} ms ({gb/min(a,a2):.1f} GB/s), "
              f"bf16 dots {min(b,b2)*1e3:.2f} ms ({gb/min(b,b2):.1f} GB/s): {min(a,a2)/min(b,b2):.2f}x; max diff {err:.1e}", flush=True)
