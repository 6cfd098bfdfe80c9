"""Decode steps of several caches of one model in one process, alternated step by step (this 2-core machine's speed
drifts by 1.5x between runs minutes apart: separate runs cannot show a few percent), and each cache's K/V bytes per
token of context per sequence.

    python scripts/dev/options_ab.py --configs full,full:kv_dtype=bfloat16,infinigen,infinigen:kv_dtype=bfloat16 \
        [--batch 1] [--prompt-len 4096] [--steps 24] [--model ID]

A config is a method and its options (`name=value`, joined by `:`; `weights=int8` runs it on the model loaded
with those weights, a second copy in the process). The prompt is prefilled once into every cache
whose method shares a prefill (bench/tee.py), each storing the rows in its own format. Prints each config's median step (ms), its
decode tokens/s and its ratio to the first config's step time.
"""

import argparse
import statistics
import sys
import time


import torch

import infinigen_kv as ig
from infinigen_kv.bench.speed import prompts
from infinigen_kv.bench.tee import TeeCache
from infinigen_kv.methods.base import cache_stats
from infinigen_kv.methods.registry import METHODS
from infinigen_kv.runtime.generation import prefill


def parse(config: str) -> tuple[str, dict]:
    method, *opts = config.split(":")
    return method, {k: value(v) for k, v in (o.split("=", 1) for o in opts)}


def value(text: str):
    """An option's value: an int, a float, or the text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="full,full:kv_dtype=bfloat16,infinigen,infinigen:kv_dtype=bfloat16")
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    configs = args.configs.split(",")
    models = {}  # weights -> (model, tokenizer): a config's `weights=` option picks the model it runs on
    for c in configs:
        w = parse(c)[1].get("weights")
        if w not in models:
            models[w] = ig.load_model(args.model, weights=w)
    B, n = args.batch, args.prompt_len
    ids, mask = prompts(next(iter(models.values()))[1], B, n)
    caches, pos, times = {}, {}, {c: [] for c in configs}
    model_of = {c: models[parse(c)[1].get("weights")][0] for c in configs}
    for c in configs:
        method, options = parse(c)
        options.pop("weights", None)
        caches[c], pos[c] = ig.make_cache(method, model_of[c], **options), n
        caches[c].reserve(n + args.steps)  # no buffer grows while timed
    for model in dict.fromkeys(model_of.values()):
        mine = [c for c in configs if model_of[c] is model]
        shared = [c for c in mine if METHODS[parse(c)[0]].shares_prefill]
        if len(shared) > 1:  # one prefill into all of them: their K/V rows as each stores them
            prefill(model, ids, mask, TeeCache([caches[c] for c in shared]), args.steps)
        for c in mine:
            if c not in shared or len(shared) == 1:
                prefill(model, ids, mask, caches[c], args.steps)
    x = torch.full((B,), 100)
    for _ in range(args.steps):
        for c in configs:
            cache = caches[c]
            p = torch.full((B, 1), pos[c])
            pos[c] += 1
            t = time.perf_counter()
            model_of[c].decode(cache, x, p, None)
            times[c].append(time.perf_counter() - t)
    first = statistics.median(times[configs[0]])
    print(f"B={B} n={n}, median of {args.steps} steps, alternated step by step")
    print("| config | K/V bytes per token per sequence | step ms | tok/s | step vs first | fetched | K/V MB read/step |")
    print("|---|---|---|---|---|---|---|")
    for c in configs:
        layers = caches[c].layers
        per_token = sum(b.heads * b.width * b.data.element_size() for layer in layers for b in (layer.k, layer.v))
        step = statistics.median(times[c])
        stats = cache_stats(caches[c])
        fetched = stats.get("fetched_fraction")
        read = stats.get("kv_bytes_per_step")
        print(f"| {c} | {per_token} | {step * 1e3:.2f} | {B / step:.1f} | {step / first:.3f}x | "
              f"{'' if fetched is None else f'{fetched:.3f}'} | {'' if read is None else f'{read / 1e6:.1f}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
