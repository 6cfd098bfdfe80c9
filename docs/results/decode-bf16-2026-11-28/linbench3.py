# The 0.5B's linears, 24 layers in bfloat16 and its LM head (988 MB), through the linear kernel with and without bfloat16 products
import time, torch, sys
from infinigen_kv.model import kernels
K = kernels.cpu()
shapes = [(1152,896),(896,896),(9728,896),(896,4864)]
layers = [[torch.randn(*s).bfloat16() for s in shapes] for _ in range(24)]
head = torch.randn(151936, 896).bfloat16()
def step(R, f, xs):
    for L in layers:
        for W in L: K.linear(xs[W.shape[1]], W, None, None, f)
    K.linear(xs[896], head, None, None, False)
def bench(g, n=7):
    g(); ts=[]
    for _ in range(n):
        t=time.perf_counter(); g(); ts.append(time.perf_counter()-t)
    return sorted(ts)[n//2]*1e3
for R in (1,2,4,8):
    xs = {896: torch.randn(R,896), 4864: torch.randn(R,4864)}
    a = bench(lambda: step(R, False, xs)); b = bench(lambda: step(R, True, xs))
    print(f"R{R}: 0.5B's linears (988 MB): f32 {a:.1f} ms, bf16 {b:.1f} ms, {a/b:.2f}x", flush=True)
