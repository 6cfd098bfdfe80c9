"""Probe: can a CUDA kernel read/write PyTorch's pinned host memory through a zero-copy view (UVA)?"""
import time, torch

class View:
    def __init__(self, t):
        self.__cuda_array_interface__ = {"shape": (t.numel() * t.element_size(),), "typestr": "|u1",
                                         "data": (t.data_ptr(), False), "version": 3}

def dview(t):
    return torch.as_tensor(View(t), device="cuda").view(t.dtype).view(t.shape)

B, G, cap, d = 4, 8, 32768 + 1024, 128
pool = torch.randn(B * G * cap, d, dtype=torch.bfloat16).pin_memory()
v = dview(pool)
print("view", v.device, v.shape, v.data_ptr() == pool.data_ptr())
idx = torch.randint(0, B * G * cap, (B * G * 3277,), device="cuda")
got = v.index_select(0, idx)
ref = pool.index_select(0, idx.cpu()).cuda()
print("gather equal", torch.equal(got, ref))
# write through the view
rows = torch.randint(0, B * G * cap, (B * G,), device="cuda")
new = torch.randn(B * G, d, dtype=torch.bfloat16, device="cuda")
v.index_copy_(0, rows, new)
torch.cuda.synchronize()
print("write equal", torch.equal(pool[rows.cpu()], new.cpu()))
# strided block write (a prompt chunk) and timing
blk = torch.randn(B, G, 8192, d, dtype=torch.bfloat16, device="cuda")
v4 = v.view(B, G, cap, d)
torch.cuda.synchronize(); t = time.perf_counter()
v4[:, :, 100:8292].copy_(blk); torch.cuda.synchronize()
w = time.perf_counter() - t
print("block write equal", torch.equal(pool.view(B, G, cap, d)[:, :, 100:8292], blk.cpu()), f"{blk.nbytes / w / 1e9:.1f} GB/s")
for n in (1638 * 8, 3277 * 8 * 4, 16384 * 8):
    idx = torch.randint(0, B * G * cap, (n,), device="cuda")
    out = torch.empty(n, d, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        torch.index_select(v, 0, idx, out=out)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(10):
        torch.index_select(v, 0, idx, out=out)
    torch.cuda.synchronize(); dt = (time.perf_counter() - t) / 10
    # staged: CPU gather into pinned + H2D
    st = torch.empty(n, d, dtype=torch.bfloat16).pin_memory(); ic = idx.cpu()
    t2 = time.perf_counter()
    for _ in range(3):
        torch.index_select(pool, 0, ic, out=st); out.copy_(st, non_blocking=True)
    torch.cuda.synchronize(); dt2 = (time.perf_counter() - t2) / 3
    print(f"rows {n}: uva gather {dt*1e3:.3f} ms ({out.nbytes/dt/1e9:.1f} GB/s); cpu gather+H2D {dt2*1e3:.3f} ms ({out.nbytes/dt2/1e9:.1f} GB/s)")
