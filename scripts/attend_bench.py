"""The `attend` kernel alone over a whole cache (full's decode attention): 30 layers of (B, 3, 4096, 64) float32
K/V, each layer its own buffers (189 MB a sequence: nothing stays in cache), GB/s of K/V read.

    python scripts/attend_bench.py [--batch 1] [--prompt-len 4096]
"""

import argparse
import time

import torch

from infinigen_kv.model import kernels


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=15)
    args = ap.parse_args()
    kern = kernels.cpu()
    if kern is None:
        raise SystemExit("attend_bench: the CPU kernels are not built here")
    L, B, G, r, d, n = 30, args.batch, 3, 3, 64, args.prompt_len  # the default model's attention
    Ks = [torch.randn(B, G, n + 64, d) for _ in range(L)]
    Vs = [torch.randn(B, G, n + 64, d) for _ in range(L)]
    q = torch.randn(B, G, r, d)

    def step():
        for K, V in zip(Ks, Vs):
            kern.attend(q, K, V, None, None, None, -1, None, n, d**-0.5, torch.float32)

    for _ in range(3):
        step()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    med = sorted(times)[len(times) // 2]
    print(f"B{B} x {n}: attend over {L} layers {med * 1e3:.2f} ms, {L * B * G * n * d * 8 / 1e9 / med:.1f} GB/s")


if __name__ == "__main__":
    main()
