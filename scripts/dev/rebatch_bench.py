"""What continuous batching costs in the cache, without a server: prefill `--rows` prompts (lengths cycling
through --lengths), join each to one running batch, then time decode steps as rows leave (a command, not a
test; results go to docs/BENCHMARKS.md).

    python scripts/dev/rebatch_bench.py [--model M] [--methods full,infinigen] [--rows 32] [--lengths 60,260,1040,2600]

Prints per method: prefill seconds, join seconds (all joins), the padded batch, then ms per decode step
and tokens/s at --rows, 16, 8, 4 and 1 rows (the first rows kept: the longest prompt stays in the batch).
"""

from __future__ import annotations

import argparse
import time

import torch

from infinigen_kv.methods.registry import make_cache
from infinigen_kv.runtime.batching import Prefill, RunningBatch
from infinigen_kv.model.load import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--methods", default="full,infinigen")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--lengths", default="60,260,1040,2600", help="prompt tokens, cycled over the rows")
    ap.add_argument("--steps", type=int, default=5, help="timed decode steps per batch size")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    model, tok = load_model(args.model)
    gen = torch.Generator().manual_seed(0)
    for method in args.methods.split(","):
        batch, prefill_s, join_s = RunningBatch(model), 0.0, 0.0
        for i in range(args.rows):
            ids = torch.randint(100, 20000, (lengths[i % len(lengths)],), generator=gen).tolist()
            p = Prefill(model, make_cache(method, model, tokenizer=tok), ids, 512)
            t = time.perf_counter()
            while not p.step():
                pass
            prefill_s += time.perf_counter() - t
            t = time.perf_counter()
            batch.join(p, 0.0, 1.0, 0, 256)
            join_s += time.perf_counter() - t
        print(f"{method}: {args.rows} rows, prefill {prefill_s:.1f} s, joins {join_s:.2f} s, "
              f"padded batch {tuple(batch.mask.shape)}", flush=True)
        for rows in sorted({args.rows, 16, 8, 4, 1}, reverse=True):
            if rows > args.rows:
                continue
            if rows < len(batch):
                batch.retain(list(range(rows)))
            ids, _ = batch.sample()
            batch.forward(ids)  # one untimed step at this size
            t = time.perf_counter()
            for _ in range(args.steps):
                ids, _ = batch.sample()
                batch.forward(ids)
            dt = (time.perf_counter() - t) / args.steps
            print(f"  {rows} rows x {batch.mask.shape[1]} columns: {dt * 1000:.0f} ms/step, {rows / dt:.1f} tokens/s",
                  flush=True)


if __name__ == "__main__":
    main()
