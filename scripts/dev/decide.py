"""What InfiniGen's dense-or-speculate rule decides for a model at given batch sizes and contexts, without running
them: the bytes a step would save (speculator.layer_saving over its speculating layers, for bfloat16 K/V rows and int8
partial keys, the defaults on CPU, with this machine's measured attention arithmetic) against min_saving of the
step's bytes and arithmetic (speculation_pays).

    python scripts/dev/decide.py [--model M] [--weights int4] --shapes 1x4096,4x4096,1x16384
"""

import argparse

import infinigen_kv as ig
from infinigen_kv.methods.infinigen.speculator import head_cost, layer_saving, speculation_pays


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--weights", default=None)
    ap.add_argument("--shapes", default="1x4096,4x4096,1x8192,1x16384", help="BxN, comma-separated")
    args = ap.parse_args()
    model, _ = ig.load_model(args.model, **({"weights": args.weights} if args.weights else {}))
    cache = ig.make_cache("infinigen", model)
    c, a = cache.config, cache.arch
    row = 2 * a.head_dim * 2  # a token's K and V of one KV head in bfloat16
    partial_row = int(a.head_dim * c.partial_ratio) + 4  # its int8 partial key and scale
    for shape in args.shapes.split(","):
        B, n = (int(v) for v in shape.split("x"))
        total = cache.weight_bytes + a.num_layers * B * a.num_kv_heads * n * (row + a.group * head_cost(cache))
        savings = [layer_saving(cache, layer, B * a.num_kv_heads, n, row, partial_row)
                   for layer in range(a.num_layers) if not cache.selection.dense(cache, layer)]
        saved = sum(x for x in savings if x is not None)
        selects = any(x is not None for x in savings)
        decided = "speculates" if selects and speculation_pays(saved, total, c.min_saving) else "dense"
        print(f"B{B} x {n}: saves {saved / 1e6:.1f} MB of {total / 1e6:.0f} MB ({saved / total:.3f}): {decided}")


if __name__ == "__main__":
    main()
