"""A kernel of a git revision against the working tree's, in one process: both builds loaded side by side,
alternated call by call (this 2-core machine's speed drifts by 1.5x between runs minutes apart; alternation in one
process cancels that), at the default model's shapes (B sequences x 3 KV heads x 3 query heads), checked to give
the same result.

    python scripts/dev/kernel_ab.py --rev HEAD~1 [--batch 4] [--prompt-len 4096] [--threads 1]
    python scripts/dev/kernel_ab.py --rev HEAD~1 --kernel attend [--batch 8] [--prompt-len 8192] [--threads 2] [--dense]
    python scripts/dev/kernel_ab.py --rev HEAD~1 --kernel linear [--weights int4] [--batch 1] [--threads 2]

speculate (32 int8 partial channels): the cap binds (alpha 12, a quarter chosen: the default at 4k), few tokens within
alpha (0.01: scores and passes only), every token within alpha and under the cap; microseconds per (sequence, KV head)
row. attend: a step's 29 layers over chosen rows (1,024 of the past per (sequence, KV head), in position order, and the
new token), each layer its own float32 pool (cold, as in a step); ms a step; with `--dense`, the 0.5B's 24 layers of
bfloat16 rows over the whole past (2 KV heads x 7 query heads), outputs within 1e-5. linear: a step's decode linears,
bfloat16 at the default model's shapes or `--weights int4` rows at Qwen2.5-0.5B's (24 layers, 896 wide, 4,864
intermediate; its LM head apart).
"""

import argparse
import hashlib
import subprocess
import tempfile
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from infinigen_kv.model import int4_rows, int8_rows, kernels
from kernel_bench import alternated  # scripts/ is on the path when run as a script

KERNELS = "src/infinigen_kv/model/kernels"


def kernel_files(rev: str | None) -> list[str]:
    """The kernels' C++ sources and headers at `rev` (None: the working tree)."""
    if rev is None:
        return sorted(p.name for p in Path(KERNELS).iterdir() if p.suffix in (".cpp", ".h"))
    out = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{KERNELS}"], capture_output=True, text=True,
                         check=True)
    return sorted(f for f in out.stdout.split() if f.endswith((".cpp", ".h")))


def build(files: dict[str, str]):
    """The kernels compiled from `files` (name -> C++ text: the sources and their header) with the library's flags,
    named by their hash."""
    key = hashlib.sha1("".join(files[f] for f in sorted(files)).encode()).hexdigest()[:10]
    folder = Path(tempfile.gettempdir()) / f"infinigen_ab_{key}"
    folder.mkdir(exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return load(name=f"infinigen_ab_{key}", sources=[str(folder / f) for f in files if f.endswith(".cpp")],
                extra_cflags=kernels._FLAGS, extra_ldflags=["-fopenmp"], verbose=False)


def show(rev: str, path: str) -> str:
    """The file at `rev` ("" where it did not exist yet)."""
    out = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)
    return out.stdout if out.returncode == 0 else ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD", help="the git revision to compare the working tree's kernels with")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--kernel", choices=["speculate", "attend", "linear"], default="speculate")
    ap.add_argument("--weights", choices=["bfloat16", "int8", "int4"], default="bfloat16", help="linear's weights")
    ap.add_argument("--dense", action="store_true", help="attend: the 0.5B's step over its whole past instead (24 "
                    "layers of bfloat16 rows, 2 KV heads x 7 query heads: full's attention, InfiniGen's dense steps)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    old = build({f: show(args.rev, f"{KERNELS}/{f}") for f in kernel_files(args.rev)})
    new = build({f: Path(KERNELS, f).read_text() for f in kernel_files(None)})
    if args.kernel == "attend":
        return dense_attend_ab(old, new, args) if args.dense else attend_ab(old, new, args)
    if args.kernel == "linear":
        return linear_ab(old, new, args)
    B, G, r, p, n = args.batch, 3, 3, 32, args.prompt_len
    rows = new.quantize_rows(torch.randn(B, G, n + 64, p))
    q = torch.randn(B, G, r, p)
    for alpha, k, what in ((12.0, n // 4, "cap binds"), (0.01, n // 4, "few within alpha"), (12.0, n + 1, "no cap")):
        def ten(m):
            for _ in range(10):
                m.speculate(q, rows, n, None, None, 0.125, alpha, k, False)

        ms = alternated([lambda: ten(old), lambda: ten(new)], args.rounds)
        med = [t * 1e3 / 10 / (B * G) for t in ms]  # us per row
        picks = [m.speculate(q, rows, n, None, None, 0.125, alpha, k, False) for m in (old, new)]
        same = torch.equal(picks[0][1], picks[1][1]) and all(
            sorted(picks[0][0][b, g, : picks[0][1][b, g]].tolist()) == sorted(picks[1][0][b, g, : picks[1][1][b, g]].tolist())
            for b in range(B) for g in range(G))
        print(f"{what:>16} (alpha {alpha}, cap {k}): {args.rev} {med[0]:.1f} us/row, working tree {med[1]:.1f} "
              f"({med[1] / med[0]:.2f}x); same selection: {same}")


def report(what: str, rev: str, med: list[float], mb: float, check: str) -> None:
    print(f"{what}, {torch.get_num_threads()} threads: {rev} {med[0]:.2f} ms a step ({mb / med[0]:.1f} GB/s), "
          f"working tree {med[1]:.2f} ({mb / med[1]:.1f} GB/s, {med[1] / med[0]:.2f}x); {check}")


def attend_ab(old, new, args, layers: int = 29, m: int = 1024):
    B, G, r, d, n = args.batch, 3, 3, 64, args.prompt_len
    g = torch.Generator().manual_seed(0)
    pools = [(torch.randn(B, G, n + 64, d, generator=g), torch.randn(B, G, n + 64, d, generator=g)) for _ in range(layers)]
    idx = [torch.rand(B, G, n, generator=g).argsort(-1)[..., :m].sort(-1).values.contiguous() for _ in range(layers)]
    count = torch.full((B, G), m, dtype=torch.int64)
    q = torch.randn(B, G, r, d, generator=g)

    def step(kern):
        return [kern.attend(q, K, V, i, count, None, n, None, n, d**-0.5, torch.float32)
                for (K, V), i in zip(pools, idx)]

    med = alternated([lambda: step(old), lambda: step(new)], args.rounds)
    same = all(torch.equal(a, b) for a, b in zip(step(old), step(new)))
    report(f"attend, B{B} x {n}, {m} chosen rows", args.rev, med, layers * B * G * (m + 1) * d * 8 / 1e6,
           f"same output: {same}")


def dense_attend_ab(old, new, args, layers: int = 24):
    B, G, r, d, n = args.batch, 2, 7, 64, args.prompt_len
    g = torch.Generator().manual_seed(0)
    pools = [tuple(torch.randn(B, G, n + 64, d, generator=g).bfloat16() for _ in range(2)) for _ in range(layers)]
    q = torch.randn(B, G, r, d, generator=g)

    def step(kern):
        # (pairs_upto 0: the widened rows' float32 products, whatever the machine's bfloat16 pairs would serve)
        return [kern.attend(q, K, V, None, None, None, -1, None, n, d**-0.5, torch.float32, 0) for K, V in pools]

    med = alternated([lambda: step(old), lambda: step(new)], args.rounds)
    close = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(step(old), step(new)))
    report(f"attend, B{B} x {n}, the whole past (bfloat16 rows, 2 x 7 heads)", args.rev, med,
           layers * B * G * n * d * 4 / 1e6, f"close (1e-5): {close}")


def linear_ab(old, new, args):
    """A step's decode linears as the own step calls them: bfloat16, the default model's 30 x (qkv, o, gate/up, down)
    and its LM head; int4 rows, the 0.5B's 24 x (qkv, o, gate/up, down); int8 rows, those and its LM head (int8 with
    int8 or int4 weights)."""
    D, FF, layers, kv = (576, 1536, 30, 192) if args.weights == "bfloat16" else (896, 4864, 24, 128)
    g = torch.Generator().manual_seed(0)
    shapes = [(D + 2 * kv, D), (D, D), (2 * FF, D), (D, FF)]
    if args.weights == "int4":
        Ws = [int4_rows.pack(torch.randn(o, i, generator=g) * 0.02) for _ in range(layers) for o, i in shapes]
    elif args.weights == "int8":
        Ws = [int8_rows.pack_kv(torch.randn(o, i, generator=g) * 0.02) for _ in range(layers) for o, i in shapes]
        Ws.append(int8_rows.pack_kv(torch.randn(151936, D, generator=g) * 0.02))
    else:
        Ws = [torch.randn(o, i, generator=g).bfloat16() for _ in range(layers) for o, i in shapes]
        Ws.append(torch.randn(49152, D, generator=g).bfloat16())
    xs = {D: torch.randn(args.batch, D, generator=g), FF: torch.randn(args.batch, FF, generator=g)}

    def step(kern):
        return [kern.linear(xs[D if W.shape[1] in (D, int4_rows.width(D), int8_rows.kv_width(D)) else FF], W, None)
                for W in Ws]

    med = alternated([lambda: step(old), lambda: step(new)], args.rounds)
    if args.weights == "int4":  # the same integer sums, the same float operations on them
        check = f"same output: {all(torch.equal(a, b) for a, b in zip(step(old), step(new)))}"
    else:  # int8 rows: within the activations' rounding where a revision changes it
        tol = (1e-2, 1e-2) if args.weights == "int8" else (1e-4, 1e-3)
        check = f"close: {all(torch.allclose(a, b, *tol) for a, b in zip(step(old), step(new)))}"
    report(f"linear ({args.weights}), {args.batch} row(s)", args.rev, med, sum(W.numel() * W.element_size() for W in Ws) / 1e6,
           check)


if __name__ == "__main__":
    main()
