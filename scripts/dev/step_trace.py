"""A decode step's ops (views excluded: they launch nothing), traced on CPU through the PyTorch path a GPU runs (the
reference backend, and CudaTransfer on CPU stand-ins): ops per step and per layer for full, offload and infinigen,
the extra ops of a speculated layer over the full cache's layer (layers 2 and on: layer 1 also speculates itself),
host reads (`.item()` and kin) inside the step, and whether two consecutive steps run the same ops on the same
buffers (what replaying one CUDA graph a step needs).

    python scripts/dev/step_trace.py [--model llama-gqa] [--prompt-len 300] [--batch 1] [--budget 0.1]

The model is one of the tests' tiny random models (infinigen_kv.testing), in float32; the tracing is the tests' own
(infinigen_kv/testing/steptrace.py).
"""

import argparse
import statistics
import sys


import torch

from infinigen_kv.model import backend
from infinigen_kv.testing import tiny_model
from infinigen_kv.testing.steptrace import run, run_static


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-gqa")
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--budget", type=float, default=0.1)
    args = ap.parse_args()

    model = tiny_model(args.model, backend=backend.reference())  # the PyTorch code a GPU runs
    ids = torch.randint(3, 200, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(0))
    rows = {m: run(model, m, ids, args.budget) for m in ("full", "offload", "infinigen")}
    for m in ("full", "offload", "infinigen"):
        rows[f"{m}, static"] = run_static(model, m, ids, args.budget)
    full_layer = statistics.median(rows["full"]["per_layer"][2:])
    print(f"{args.model}, B{args.batch} x {args.prompt_len}, budget {args.budget}, reference backend, torch {torch.__version__}")
    print("| method | ops/step | ops/layer (median, layers 2+) | extra ops/layer vs full | host reads/step | two steps |")
    print("|---|---|---|---|---|---|")
    for m, r in rows.items():
        layer = statistics.median(r["per_layer"][2:])
        same = "identical" if r["same"] is None else "differ: " + r["same"][:100]
        print(f"| {m} | {r['ops']} | {layer:g} | {layer - full_layer:+g} | {r['host_reads']} | {same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
