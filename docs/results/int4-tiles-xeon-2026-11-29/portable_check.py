"""The int4 tile kernel built for AVX2 (haswell) and for plain x86-64 (scalar): the same bits as the native build."""
import sys, torch
from torch.utils.cpp_extension import load
from infinigen_kv.model import int4_rows, kernels
from infinigen_kv.model.kernels import _SOURCES, _FLAGS
native = kernels.cpu()
torch.manual_seed(0)
cases = []
for out, inn in [(37, 576), (48, 64), (1152, 896), (5, 96)]:
    W = torch.randn(out, inn) * torch.rand(out, 1)
    cases.append((int4_rows.pack(W), torch.randn(6, inn) * 3))
for arch in ("haswell", "x86-64"):
    flags = [f for f in _FLAGS if not f.startswith("-march")] + [f"-march={arch}"]
    mod = load(name=f"ig_portable_{arch.replace('-', '_')}", sources=[str(p) for p in _SOURCES], extra_cflags=flags,
               extra_ldflags=["-fopenmp"], verbose=False)
    for held, x in cases:
        a, b = native.linear(x, held, None, None, False), mod.linear(x, held, None, None, False)
        print(arch, tuple(held.shape), "equal" if torch.equal(a, b) else f"DIFF {(a - b).abs().max():.3g}", flush=True)
        assert torch.equal(native.dequantize_q4_rows(held, int4_rows.dim(held.shape[1]), False),
                           mod.dequantize_q4_rows(held, int4_rows.dim(held.shape[1]), False))
