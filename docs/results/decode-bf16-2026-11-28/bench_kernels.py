"""The decode kernels alone, on whichever tree is on PYTHONPATH: the 0.5B's linears (24 layers' q/k/v, o, gate/up,
down in bfloat16 + its LM head, 988 MB: read from memory each pass) at 1-8 rows; attention of one layer of the
0.5B's shape (2 K/V heads of 64, 7 query heads each) over 410 / 1,640 chosen rows or the whole past of 4k / 16k;
speculate (int8 partial keys of 32 channels) over 4k / 16k."""
import time, torch
from infinigen_kv.model import kernels
K = kernels.cpu()
torch.manual_seed(0)
def med(f, n):
    f(); ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e3
def lin(x, W, bf16):
    try:
        return K.linear(x, W, None, None, bf16)
    except TypeError:  # before: no bf16 argument (float32 products)
        return K.linear(x, W, None, None)
shapes = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]
layers = [[torch.randn(*s).bfloat16() for s in shapes] for _ in range(24)]
head = torch.randn(151936, 896).bfloat16()
for R in (1, 2, 4, 8):
    xs = {896: torch.randn(R, 896), 4864: torch.randn(R, 4864)}
    def step():
        for L in layers:
            for W in L:
                lin(xs[W.shape[1]], W, True)
        lin(xs[896], head, False)
    print(f"linears, {R} rows: {med(step, 9):.1f} ms", flush=True)
del layers, head
for B, n, m in ((1, 4096, 410), (1, 16384, 1640), (4, 4096, 410), (4, 16384, 1640)):
    G, r, d, cap = 2, 7, 64, n + 64
    q = torch.randn(B, G, r, d)
    Kp, Vp = (torch.randn(B, G, cap, d).bfloat16() for _ in range(2))
    idx = torch.sort(torch.randperm(n)[:m])[0].expand(B, G, m).contiguous()
    count, new = torch.full((B, G), m), torch.full((B, G), n)
    P = torch.randint(-127, 128, (B, G, cap, 36), dtype=torch.int8)
    P[..., 32:] = torch.full((B, G, cap, 1), 0.01).view(torch.int8)
    qp = torch.randn(B, G, r, 32)
    chosen = med(lambda: K.attend(q, Kp, Vp, idx, count, new, -1, None, 0, 0.125, torch.float32), 51)
    dense = med(lambda: K.attend(q, Kp, Vp, None, None, None, -1, None, n + 1, 0.125, torch.float32), 51)
    spec = med(lambda: K.speculate(qp, P, n, None, None, 0.125, 4.0, m, False), 51)
    print(f"B{B} x {n}: attend {m} chosen {chosen * 1e3:.0f} us, whole past {dense * 1e3:.0f} us; speculate {spec * 1e3:.0f} us",
          flush=True)
