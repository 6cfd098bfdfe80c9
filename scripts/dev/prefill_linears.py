"""A prompt chunk's linears, one of each shape and held kind: the BLAS on the weight dequantized (bfloat16 products
where the CPU has them) against the `linear` kernel's integer products (backend.int_prefill), alternated in one
process, medians; then the prefill of a prompt both ways (the model's own forward).

    python scripts/dev/prefill_linears.py [--model M] [--rows 512] [--prompt-len 4096] [--repeats 5]
"""

import argparse
import dataclasses
import statistics
import time

import torch

import infinigen_kv as ig
from infinigen_kv.model import ops
from infinigen_kv.model.load import load_model
from infinigen_kv.runtime.generation import prefill


HELD = {torch.int8: "int8 rows", torch.uint8: "int4 tiles", torch.float8_e5m2: "int5 tiles", torch.bfloat16: "bfloat16"}


def timed(f, repeats: int) -> float:
    f()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", type=int, default=512, help="rows of a prompt chunk")
    ap.add_argument("--prompt-len", type=int, default=4096, help="the prefill's prompt (0: none)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    model, _ = load_model(args.model)
    modes = {"gemm": dataclasses.replace(model.backend, int_prefill=False),
             "integer": dataclasses.replace(model.backend, int_prefill=True)}
    seen = {}
    for name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if hasattr(mod, "in_features") and w is not None and w.dim() == 2:
            seen.setdefault((mod.in_features, mod.out_features, w.dtype), (name, w, getattr(mod, "bias", None)))
    print("| linear | held | in x out | gemm ms | integer ms | GMAC/s gemm / integer | integer / gemm |")
    print("|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for (n_in, n_out, dtype), (name, w, bias) in seen.items():
        x = torch.randn(args.rows, n_in)
        if bias is not None and not isinstance(bias, torch.Tensor):
            bias = None
        ms = {}
        for _ in range(2):  # alternated
            for mode, be in modes.items():
                ms.setdefault(mode, []).append(timed(lambda: ops.linear(x, w, bias, be, prefill=True), args.repeats))
        g, i = (statistics.median(ms[m]) for m in ("gemm", "integer"))
        macs = args.rows * n_in * n_out / 1e9
        print(f"| {name} | {HELD.get(dtype, dtype)} | {n_in} x {n_out} | {g * 1e3:.2f} | {i * 1e3:.2f} | "
              f"{macs / g:.0f} / {macs / i:.0f} | {g / i:.2f}x |")
    if args.prompt_len:
        ids = torch.randint(100, 10000, (1, args.prompt_len))
        for mode in ("gemm", "integer", "gemm", "integer"):
            model.backend = modes[mode]
            cache = ig.make_cache("full", model)
            t = time.perf_counter()
            prefill(model, ids, cache=cache)
            s = time.perf_counter() - t
            print(f"prefill of {args.prompt_len} tokens, {mode}: {s:.2f} s, {args.prompt_len / s:.1f} tok/s")


if __name__ == "__main__":
    main()
