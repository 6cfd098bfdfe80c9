import time, torch
from infinigen_kv.model import attention, kernels
torch.set_grad_enabled(False)
K = kernels.cpu()
def t(f, n=3):
    f(); s = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - s) / n
for past in (4096, 16384, 31744):
    T, H, G, d = 512, 14, 2, 64
    S = past + T
    q = torch.randn(1, H, T, d); kb = torch.randn(1, G, S, d).bfloat16(); vb = torch.randn(1, G, S, d).bfloat16()
    mask = (torch.arange(S)[None] <= torch.arange(T)[:, None] + past)[None, None]
    def old():
        k, v = kb.float(), vb.float()
        return attention.sdpa(q, k, v, mask, d**-0.5)
    def new():
        return K.prefill_attend(q[0].transpose(0, 1), kb[0], vb[0], d**-0.5)
    a, b = t(old), t(new)
    flop = 4 * T * (past + T / 2) * d * H
    err = (old()[0] - new()).abs().max().item()
    print(f"past {past}: sdpa {a*1e3:.1f} ms ({flop/a/1e9:.0f} GFLOP/s), kernel {b*1e3:.1f} ms ({flop/b/1e9:.0f} GFLOP/s), {a/b:.2f}x, max err {err:.2e}", flush=True)
