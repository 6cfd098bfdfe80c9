"""Where a decode step's time goes: wall time per step for `full` and `infinigen`, and InfiniGen's parts
(speculation with its partial query and kernel, update, attention) summed over the layers of a step. The step
generate runs (model.decode).

    python scripts/dev/profile_decode.py [--batch 4] [--prompt-len 4096] [--steps 8] [--weights int4] [--cprofile 25]

--cprofile N: then the same steps again under cProfile, each method's N functions of most own time (the Python
around the kernels; cProfile slows each call, so its times rank, they do not measure a step).
"""

import argparse
import collections
import dataclasses
import cProfile
import pstats
import time
import types

import torch

import infinigen_kv as ig
from infinigen_kv.model import attention as attention_mod
from infinigen_kv.model import kernels
from infinigen_kv.methods.infinigen import cache as cache_mod
from infinigen_kv.methods.infinigen import layer as layer_mod
from infinigen_kv.methods.infinigen import speculator as selection_mod
from infinigen_kv.bench.speed import prompts
from infinigen_kv.bench.tee import TeeCache
from infinigen_kv.runtime.generation import prefill

TIMES = collections.defaultdict(float)


def timed(owner, name, label):
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        TIMES[label] += time.perf_counter() - t
        return out

    setattr(owner, name, wrapper)


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--weights", default=None, help="bfloat16 (the CPU default), int8 or int4")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--cprofile", type=int, default=0, metavar="N", help="then N functions of most own time")
    args = ap.parse_args()
    model, tok = ig.load_model(args.model, weights=args.weights)
    B, n = args.batch, args.prompt_len
    kern = kernels.library()
    ns = None
    if kern is not None:  # the compiled module's functions, wrapped on a stand-in object the backend passes down
        ns = types.SimpleNamespace(**{k: getattr(kern, k) for k in dir(kern) if not k.startswith("_")})
        kernels._module = ns
        if model.backend.ops is kern:
            model.backend = dataclasses.replace(model.backend, ops=ns)
        timed(ns, "speculate", "  speculate kernel (scores, count, selection)")
        timed(ns, "attend", "attention kernel (all layers, full's too)")
        timed(ns, "linear", "linear kernel (all decode linears)")
        timed(ns, "partial_query", "  partial query kernel")
        timed(ns, "rms_norm", "rms_norm kernel")
        timed(ns, "store_token", "store_token kernel")
    ids, mask = prompts(tok, B, n)
    caches = {method: ig.make_cache(method, model) for method in ("full", "infinigen")}
    for cache in caches.values():
        cache.reserve(n + 2 + 2 * args.steps)  # the timed (and profiled) steps: no buffer grows then
    prefill(model, ids, mask, TeeCache(list(caches.values())), 2 + 2 * args.steps)  # one prefill into both
    for cache in caches.values():  # two steps each before the timed ones
        for i in range(2):
            model.decode(cache, torch.full((B,), 100), torch.full((B, 1), n + i), None)
    timed(cache_mod.InfiniGenCache, "before_attention", "speculation")
    timed(cache_mod.InfiniGenCache, "partial_query", "  partial query")
    timed(selection_mod, "approx_scores", "  approximate scores (PyTorch path)")
    timed(selection_mod, "select", "  selection (PyTorch path)")
    timed(layer_mod.PoolLayer, "view", "view (pool append, fetch)")
    timed(attention_mod, "attend", "attention")
    x = torch.full((B, 1), 100)
    for method, cache in caches.items():
        TIMES.clear()
        walls = []
        for i in range(args.steps):
            pos = torch.full((B, 1), n + 2 + i)
            t = time.perf_counter()
            model.decode(cache, x[:, 0], pos, None)
            walls.append(time.perf_counter() - t)
        walls.sort()
        print(f"{method}: median step {walls[len(walls) // 2] * 1e3:.1f} ms (B={B}, n={n})")
        for label, s in TIMES.items():
            print(f"  {label}: {s / args.steps * 1e3:.1f} ms/step")
        if args.cprofile:
            prof = cProfile.Profile()
            for i in range(args.steps):
                pos = torch.full((B, 1), n + 2 + args.steps + i)
                prof.runcall(model.decode, cache, x[:, 0], pos, None)
            print(f"{method}: cProfile over {args.steps} steps, by own time")
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)


if __name__ == "__main__":
    main()
