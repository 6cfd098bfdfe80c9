"""Which int8 format for K/V rows? Decode-mode perplexity (windows of W tokens of WikiText-2, the first P prefilled)
of the full cache over float32 rows, rows passed through symmetric int8 quantization with one float32 scale per
(token, head) row, and the int8 rows as `kv_dtype="int8"` stores them (llama.cpp's q8_0: a float16 scale per 32
values).

    python scripts/dev/kv_format_study.py --data DIR [--model M] [--windows 8] [--window 2048] [--prefix 1024]

Prints a markdown table (the source of the int8 row format, docs/BENCHMARKS.md).
"""

import argparse
import time
from pathlib import Path

import torch

import infinigen_kv as ig
from infinigen_kv.bench.accuracy import load_text, run_ppl
from infinigen_kv.methods.full import FullLayer


def fake_int8(x: torch.Tensor, group: int) -> torch.Tensor:
    """x (..., d) through symmetric int8 codes with one absmax / 127 scale per `group` values (d: per row)."""
    *lead, d = x.shape
    xg = x.float().reshape(*lead, d // group, group)
    scale = xg.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, (xg / scale).round().clamp(-127, 127), 0)
    return (q * scale).reshape(*lead, d).to(x.dtype)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="folder holding wikitext-2/test.txt")
    ap.add_argument("--model", default=None)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--prefix", type=int, default=1024)
    args = ap.parse_args()
    model, tok = ig.load_model(args.model)
    ids = torch.tensor(tok(load_text(args.data))["input_ids"])
    c = model.config
    d = c.head_dim
    view = FullLayer.view
    rows = []
    for name, kv_dtype, group in (("float32", "float32", None),
                                  (f"int8, a float32 scale per row ({d} values)", "float32", d),
                                  ("int8, a float16 scale per 32 values (q8_0; `kv_dtype=int8`)", "int8", None)):
        if group:
            def fake(self, k, v, *a, g=group, **kw):
                return view(self, fake_int8(k, g), fake_int8(v, g), *a, **kw)

            FullLayer.view = fake
        t = time.time()
        ppl, _ = run_ppl(model, ids, "full", None, {"kv_dtype": kv_dtype}, args.window, args.prefix, args.windows)
        FullLayer.view = view
        rows.append((name, ppl, time.time() - t))
    base = rows[0][1]
    name = Path(args.model or "default model").name
    print(f"\n{name}: {args.windows} windows of {args.window}, {args.prefix} prefilled\n")
    print("| K/V rows | perplexity | vs float32 |\n|---|---|---|")
    for name, ppl, _ in rows:
        print(f"| {name} | {ppl:.4f} | {100 * (ppl / base - 1):+.3f}% |")


if __name__ == "__main__":
    main()
