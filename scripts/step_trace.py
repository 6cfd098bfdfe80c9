"""A decode step's ops (views excluded: they launch nothing), traced on CPU through the PyTorch path a GPU runs (the
reference backend, and CudaTransfer on CPU stand-ins): ops per step and per layer for full, offload and infinigen,
the extra ops of a speculated layer over the full cache's layer (layers 2 and on: layer 1 also speculates itself),
host reads (`.item()` and kin) inside the step, and whether two consecutive steps run the same ops on the same
buffers (what replaying one CUDA graph a step needs).

    python scripts/step_trace.py [--model llama-gqa] [--prompt-len 300] [--batch 1] [--budget 0.1]

The model is one of the tests' tiny random models (tests/conftest.py), in float32.
"""

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

import torch  # noqa: E402

import infinigen_kv as ig  # noqa: E402
from infinigen_kv.model import kernels  # noqa: E402
from infinigen_kv.model.step import decode  # noqa: E402
from infinigen_kv.runtime.generation import prefill  # noqa: E402


def traced(cache, fn):
    """(a StepTrace of fn(), its result), marked at each layer's before_attention (the layers' boundaries)."""
    from steptrace import StepTrace

    t, before = StepTrace(), cache.before_attention
    cache.before_attention = lambda *a: (t.mark(), before(*a))[1]
    try:
        with t:
            out = fn()
    finally:
        del cache.before_attention
    return t, out


def summary(a, b) -> dict:
    """Two consecutive steps' traces: kernels a step and per layer, host reads, where they part (None: nowhere)."""
    from steptrace import first_difference

    per_layer = [y[1] - x[1] for x, y in zip(a.marks, a.marks[1:])]
    return {"ops": a.kernels, "per_layer": per_layer, "host_reads": len(a.host_reads), "same": first_difference(a, b)}


def _cache(model, method: str, budget: float, ids):
    cache = ig.make_cache(method, model, **({"budget": budget, "min_budget": 0} if method == "infinigen" else {}))
    if ids.device.type == "cpu" and method != "full":
        from conftest import on_fake_cuda

        on_fake_cuda(cache)  # the GPU's transfer (CudaTransfer on CPU stand-ins): the ops a GPU step runs
    return cache


def run(model, method: str, ids, budget: float) -> dict:
    """Trace the 3rd and 4th decode steps of `method` after a prefill of ids (B, n) (summary)."""
    cache = _cache(model, method, budget, ids)
    B, n = ids.shape
    tok = prefill(model, ids, None, cache, 8).argmax(-1)  # the step's inputs in buffers of their own, refilled
    pos = torch.full((B, 1), n, device=ids.device)  # in place (as a graph replays them)
    traces = []
    for i in range(4):  # two warm-up steps, two traced
        pos.fill_(n + i)
        t, logits = traced(cache, lambda: decode(model, cache, tok, pos, None))
        tok.copy_(logits.argmax(-1))
        traces.append(t)
    return summary(*traces[2:])


def run_static(model, method: str, ids, budget: float) -> dict:
    """The same, through static steps (model/static.py: what a CUDA graph replays)."""
    from infinigen_kv.model.static import StaticDecoder

    cache = _cache(model, method, budget, ids)
    B, n = ids.shape
    tok = prefill(model, ids, None, cache, 8).argmax(-1)
    dec = StaticDecoder(model, cache, None, torch.full((B, 1), n, device=ids.device))
    traces = []
    for _ in range(4):
        dec.refill(tok)
        t, logits = traced(cache, dec.forward)
        dec.advance()
        tok = logits.argmax(-1)
        traces.append(t)
    return summary(*traces[2:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-gqa")
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--budget", type=float, default=0.1)
    args = ap.parse_args()
    from conftest import tiny_model

    kernels._enabled = False  # the reference backend: the PyTorch code a GPU runs
    model = tiny_model(args.model)
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
