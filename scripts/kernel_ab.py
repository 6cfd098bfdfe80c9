"""The `speculate` kernel of a git revision against the working tree's, in one process: both builds loaded side by
side, alternated call by call (this 2-core machine's speed drifts by 1.5x between runs minutes apart; alternation
in one process cancels that), at the default model's shapes (B sequences x 3 KV heads x 3 query heads, 32 int8
partial channels, 4k tokens), and checked to choose the same tokens.

    python scripts/kernel_ab.py --rev HEAD~1 [--batch 4] [--prompt-len 4096] [--threads 1]

Cases: the cap binds (alpha 12, a quarter chosen: the default at 4k), few tokens within alpha (0.01: scores and
passes only), every token within alpha and under the cap. Prints microseconds per (sequence, KV head) row.
"""

import argparse
import hashlib
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from infinigen_kv.model import kernels

SRC = "src/infinigen_kv/model/kernels/cpu.cpp"


def build(source: str):
    """The kernels compiled from `source` (C++ text) with the library's flags, named by its hash."""
    key = hashlib.sha1(source.encode()).hexdigest()[:10]
    path = Path(tempfile.gettempdir()) / f"infinigen_ab_{key}.cpp"
    path.write_text(source)
    return load(name=f"infinigen_ab_{key}", sources=[str(path)], extra_cflags=kernels._FLAGS,
                extra_ldflags=["-fopenmp"], verbose=False)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD", help="the git revision to compare the working tree's kernels with")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    old = build(subprocess.run(["git", "show", f"{args.rev}:{SRC}"], capture_output=True, text=True, check=True).stdout)
    new = build(Path(SRC).read_text())
    B, G, r, p, n = args.batch, 3, 3, 32, args.prompt_len
    rows = new.quantize_rows(torch.randn(B, G, n + 64, p))
    q = torch.randn(B, G, r, p)
    for alpha, k, what in ((12.0, n // 4, "cap binds"), (0.01, n // 4, "few within alpha"), (12.0, n + 1, "no cap")):
        times = {0: [], 1: []}
        for _ in range(args.rounds):
            for i, m in enumerate((old, new)):
                t = time.perf_counter()
                for _ in range(10):
                    m.speculate(q, rows, n, None, None, 0.125, alpha, k, False)
                times[i].append((time.perf_counter() - t) / 10 / (B * G) * 1e6)
        picks = [m.speculate(q, rows, n, None, None, 0.125, alpha, k, False) for m in (old, new)]
        same = torch.equal(picks[0][1], picks[1][1]) and all(
            sorted(picks[0][0][b, g, : picks[0][1][b, g]].tolist()) == sorted(picks[1][0][b, g, : picks[1][1][b, g]].tolist())
            for b in range(B) for g in range(G))
        med = [sorted(times[i])[len(times[i]) // 2] for i in (0, 1)]
        print(f"{what:>16} (alpha {alpha}, cap {k}): {args.rev} {med[0]:.1f} us/row, working tree {med[1]:.1f} "
              f"({med[1] / med[0]:.2f}x); same selection: {same}")


if __name__ == "__main__":
    main()
