"""The constant InfiniGen's dense-or-speculate rule gives a (past token, query head) of decode attention on a kernel
path (model/backend.py, PATHS[path].head_ns): wall ns of `attend` over 4 x 2 rows of 4,096 bfloat16 tokens of 64
channels, 8 query heads a KV head, on 2 threads, the MINIMUM of many runs (a busy machine only ever adds time: the
minimum of a quiet machine is the path's cost), the products as the path's backend multiplies them. --arch builds
the kernels for another -march (haswell: the AVX2 path) on this machine.

    python scripts/dev/head_ns.py [--arch haswell] [--runs 30]
"""
import argparse
import time

import torch

from infinigen_kv.model import backend, kernels

ap = argparse.ArgumentParser()
ap.add_argument("--arch", default=None, help="build for this -march (default: the native build)")
ap.add_argument("--runs", type=int, default=30)
ap.add_argument("--threads", type=int, default=2)
a = ap.parse_args()
torch.set_num_threads(a.threads)
if a.arch is None:
    mod, b = kernels.library(), backend.build("cpu")
    path, pairs = b.path, b.attend_pairs_upto
else:
    from torch.utils.cpp_extension import load

    flags = [f for f in kernels._FLAGS if not f.startswith("-march")] + [f"-march={a.arch}"]
    mod = load(name=f"ig_portable_{a.arch.replace('-', '_')}", sources=[str(p) for p in kernels._SOURCES],
               extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
    path, pairs = f"-march={a.arch}", 0
B, G, r, n = 4, 2, 8, 4096
g = torch.Generator().manual_seed(0)
K, V = (torch.randn(B, G, n, 64, generator=g).bfloat16() for _ in range(2))
q = torch.randn(B, G, r, 64, generator=g)
times = []
for _ in range(a.runs + 1):
    t = time.perf_counter()
    mod.attend(q, K, V, None, None, None, -1, None, n, 0.125, torch.float32, pairs)
    times.append(time.perf_counter() - t)
per = [t * 1e9 / (B * G * r * n) for t in times[1:]]
print(f"{path}: head_ns min {min(per):.3f}, median {sorted(per)[len(per) // 2]:.3f} "
      f"(pairs_upto {pairs}, {a.threads} threads, {a.runs} runs; CPU {kernels.cpu_vendor()})")
