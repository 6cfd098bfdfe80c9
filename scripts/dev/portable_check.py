"""The int4, int5, int6 and int8 tile kernels built for AVX2 (haswell) and for plain x86-64 (the scalar path): the same bits as
this machine's native build, linear and dequantization alike (a weight's rows after its last tile, int4 rows read
one at a time, sum in each path's own order: their difference is printed, not required to be zero).

    python scripts/dev/portable_check.py          # ~2 minutes a build on 2 cores
"""
import torch
from torch.utils.cpp_extension import load

import numpy as np

from infinigen_kv.model import int4_rows, int5_rows, int6_tiles, int8_tiles, kernels
from infinigen_kv.testing.gguf import quantize_q6_k
from infinigen_kv.model.kernels import _FLAGS, _SOURCES

native = kernels.library()
torch.manual_seed(0)
cases = []
for out, inn in [(37, 576), (48, 64), (1152, 896), (5, 96), (64, 512)]:
    W = torch.randn(out, inn) * torch.rand(out, 1)
    cases.append(("int4", int4_rows.pack(W), torch.randn(6, inn) * 3))
    if out % 16 == 0:
        cases.append(("int5", int5_rows.pack(W), torch.randn(6, inn) * 3))
    cases.append(("int8", int8_tiles.pack(W), torch.randn(6, inn) * 3))
    if int6_tiles.fits(out, inn):
        cases.append(("int6", int6_tiles.tiled(torch.from_numpy(quantize_q6_k(W.numpy()))), torch.randn(6, inn) * 3))
for arch in ("haswell", "x86-64"):
    flags = [f for f in _FLAGS if not f.startswith("-march")] + [f"-march={arch}"]
    mod = load(name=f"ig_portable_{arch.replace('-', '_')}", sources=[str(p) for p in _SOURCES], extra_cflags=flags,
               extra_ldflags=["-fopenmp"], verbose=False)
    for form, held, x in cases:
        for rows in (1, 2, 4, 6):
            a = native.linear(x[:rows].contiguous(), held, None, None, False)
            b = mod.linear(x[:rows].contiguous(), held, None, None, False)
            if held.shape[0] % 16:
                tail = f"rows after the tiles: max difference {(a - b).abs().max():.3g}"
            else:
                assert torch.equal(a, b), (arch, form, tuple(held.shape), rows, (a - b).abs().max())
        if form == "int4":
            n = int4_rows.dim(held.shape[1])
            same = torch.equal(native.dequantize_q4_rows(held, n, False), mod.dequantize_q4_rows(held, n, False))
        elif form == "int6":
            n = int6_tiles.dim(held.shape[1])
            same = torch.equal(native.dequantize_q6_tiles(held, n, False), mod.dequantize_q6_tiles(held, n, False))
        elif form == "int5":
            n = int5_rows.dim(held.shape[1])
            same = torch.equal(native.dequantize_q5_tiles(held, n, False), mod.dequantize_q5_tiles(held, n, False))
        else:
            n = int8_tiles.int8_rows.kv_dim(held.shape[1])
            same = torch.equal(native.dequantize_q8_tiles(held, n, False), mod.dequantize_q8_tiles(held, n, False))
        assert same, (arch, form, "dequantize")
        print(arch, form, tuple(held.shape), "equal" if held.shape[0] % 16 == 0 else tail, flush=True)
print("every build gives the native bits")
