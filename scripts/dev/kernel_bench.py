"""A decode kernel alone at the default model's shapes, each layer its own buffers (nothing stays in cache):

  attend  over a whole cache: 30 layers of (B, 3, prompt-len, 64) K/V in --kv-dtype (float32, the caches'
          storage; bfloat16; or both, alternated step by step), GB/s of K/V read; --chosen M: over M scattered
          rows of each (sequence, KV head) instead (sorted, as `speculate` returns them: InfiniGen's fetch)
  speculate  InfiniGen's selection over 29 layers of partial keys (B, 3, prompt-len, 32): --partial-dtype
          bfloat16 (the default's) or int8 (rows of 32 values and their scale), a quarter of the past chosen
          (the default floor at 4k), GB/s of partial keys read
  linear  the 121 decode matrices of a step as the own step calls them (30 layers x qkv merged, o, gate/up
          merged, down, and the LM head) in bfloat16, --batch rows each, GB/s of weights read

    python scripts/dev/kernel_bench.py --kernel attend [--batch 1] [--prompt-len 4096] [--kv-dtype float32,bfloat16]
                                   [--chosen 1024]
    python scripts/dev/kernel_bench.py --kernel speculate [--batch 4] [--partial-dtype int8] [--alpha 0.01] [--threads 1]
    python scripts/dev/kernel_bench.py --kernel linear [--batch 4]
"""

import argparse
import time

import torch

from infinigen_kv.model import kernels

LAYERS, D, FF, VOCAB = 30, 576, 1536, 49152  # SmolLM2-135M


def attend_step(kern, batch: int, n: int, dtype: torch.dtype, chosen: int | None):
    G, r, d = 3, 3, 64
    Ks = [torch.randn(batch, G, n + 64, d).to(dtype) for _ in range(LAYERS)]
    Vs = [torch.randn(batch, G, n + 64, d).to(dtype) for _ in range(LAYERS)]
    q = torch.randn(batch, G, r, d)
    if not chosen:
        def step():
            for K, V in zip(Ks, Vs):
                kern.attend(q, K, V, None, None, None, -1, None, n, d**-0.5, torch.float32)

        return step, LAYERS * batch * G * n * d * 2 * Ks[0].element_size()
    m = min(chosen, n)
    idx = [torch.rand(batch * G, n).argsort(-1)[:, :m].sort(-1).values.view(batch, G, m) for _ in range(LAYERS)]
    count = torch.full((batch, G), m, dtype=torch.long)

    def step():  # the chosen rows and the new token's (slot n)
        for K, V, i in zip(Ks, Vs, idx):
            kern.attend(q, K, V, i, count, None, n, None, 0, d**-0.5, torch.float32)

    return step, LAYERS * batch * G * (m + 1) * d * 2 * Ks[0].element_size()


def speculate_step(kern, batch: int, n: int, dtype: str, alpha: float = 12.0):
    G, r, p = 3, 3, 32
    keys = [torch.randn(batch, G, n + 64, p) for _ in range(LAYERS - 1)]  # layer 0 is never speculated
    rows = [kern.quantize_rows(k) if dtype == "int8" else k.bfloat16() for k in keys]
    q = torch.randn(batch, G, r, p)

    def step():
        for kp in rows:
            kern.speculate(q, kp, n, None, None, 0.125, alpha, n // 4, False)

    return step, sum(kp[:, :, :n].numel() * kp.element_size() for kp in rows)


def linear_step(kern, batch: int):
    shapes = [(D + 2 * 192, D), (D, D), (2 * FF, D), (D, FF)]
    Ws = [torch.randn(o, i).bfloat16() for _ in range(LAYERS) for o, i in shapes] + [torch.randn(VOCAB, D).bfloat16()]
    xs = {D: torch.randn(batch, D), FF: torch.randn(batch, FF)}

    def step():
        for w in Ws:
            kern.linear(xs[w.shape[1]], w, None)

    return step, sum(w.numel() * 2 for w in Ws)


def alternated(fns, rounds: int, warmup: int = 0) -> list[float]:
    """Median ms of each of `fns`, called in turn `rounds` times after `warmup` untimed rounds: one process, the
    same machine state for all (this 2-core machine's speed drifts by 1.5x between runs minutes apart)."""
    times = [[] for _ in fns]
    for _ in range(warmup + rounds):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
    return [sorted(ts[warmup:])[rounds // 2] for ts in times]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=["attend", "speculate", "linear"], default="attend")
    ap.add_argument("--partial-dtype", choices=["bfloat16", "int8"], default="bfloat16")
    ap.add_argument("--kv-dtype", default="float32", help="attend: float32, bfloat16, or both (float32,bfloat16: "
                    "alternated step by step)")
    ap.add_argument("--chosen", type=int, default=None, help="attend: over this many scattered rows of each "
                    "(sequence, KV head), not the whole past")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--alpha", type=float, default=12.0, help="speculate: 0.01 leaves few tokens within alpha (no "
                    "bisection: the scores and passes alone); 12 (the default's) lets the quarter cap bind")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not set(args.kv_dtype.split(",")) <= {"float32", "bfloat16"}:
        ap.error(f"--kv-dtype: float32 and/or bfloat16, got {args.kv_dtype!r}")
    kern = kernels.library()
    if kern is None:
        raise SystemExit("kernel_bench: the CPU kernels are not built here")
    shape = f"{args.batch} row(s)" if args.kernel == "linear" else f"B{args.batch} x {args.prompt_len}"
    if args.kernel == "attend":  # each K/V dtype named: their steps alternate, one process, the same machine state
        cases = [(f"{shape}, {dt} K/V" + (f", {args.chosen} chosen rows" if args.chosen else ""),
                  *attend_step(kern, args.batch, args.prompt_len, getattr(torch, dt), args.chosen))
                 for dt in args.kv_dtype.split(",")]
    elif args.kernel == "speculate":
        cases = [(f"{shape}, {args.partial_dtype}, alpha {args.alpha:g}, {torch.get_num_threads()} threads",
                  *speculate_step(kern, args.batch, args.prompt_len, args.partial_dtype, args.alpha))]
    else:
        cases = [(shape, *linear_step(kern, args.batch))]
    meds = alternated([step for _, step, _ in cases], args.steps, warmup=3)
    for (label, _, nbytes), med in zip(cases, meds):
        print(f"{args.kernel}, {label}: {med:.2f} ms a step, {nbytes / 1e6:.0f} MB, {nbytes / 1e6 / med:.1f} GB/s")


if __name__ == "__main__":
    main()
