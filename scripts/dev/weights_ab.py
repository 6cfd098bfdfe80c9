"""Decode speed of one model held two (or more) ways, in one process: each held form prefilled once per method on the
same prompt, then their decode runs alternated (A B A B ...), the median of each, and the ratios to the first form.
Speeds wander between sittings and minutes; alternating in one process is what makes the ratio mean something.

    python scripts/dev/weights_ab.py --model M.gguf --weights auto,int4 [--methods full,infinigen] [--prompt-len 4096]
"""

import argparse
import json
import statistics
import time


import infinigen_kv as ig
from infinigen_kv.bench.speed import prompts
from infinigen_kv.runtime.generation import generate, prefill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--weights", default="auto,int4")
    ap.add_argument("--methods", default="full,infinigen")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    models = {w: ig.load_model(args.model, weights=w) for w in args.weights.split(",")}
    tok = next(iter(models.values()))[1]
    ids, mask = prompts(tok, args.batch, args.prompt_len)
    n = args.new_tokens * (args.repeats + 1)
    runs = {}
    for w, (model, _) in models.items():  # each (form, method): prefilled once, a fork of it decoded each run
        for m in args.methods.split(","):
            cache = ig.make_cache(m, model, tokenizer=tok)
            logits = prefill(model, ids, mask, cache, n)
            runs[(w, m)] = (model, cache, logits)
            print(f"prefilled {w} {m}", flush=True)
    times = {k: [] for k in runs}
    for _ in range(args.repeats + 1):
        for (w, m), (model, cache, logits) in runs.items():
            res = generate(model, ids, mask, cache=cache.fork(), max_new_tokens=args.new_tokens, stop_at_eos=False,
                           prefilled=logits)
            times[(w, m)].append(res.decode_tokens_per_s)
    rows = []
    first = args.weights.split(",")[0]
    for (w, m), ts in times.items():
        speed = statistics.median(ts[1:])  # (the first: a warm-up)
        ref = statistics.median(times[(first, m)][1:])
        rows.append({"weights": w, "method": m, "decode_tokens_per_s": round(speed, 2), "ratio": round(speed / ref, 3),
                     "runs": [round(t, 2) for t in ts[1:]]})
        print(f"{w:9s} {m:10s} {speed:7.2f} tok/s  {speed / ref:.3f}x {first}  runs {rows[-1]['runs']}", flush=True)
    if args.json:
        json.dump({"model": args.model, "batch": args.batch, "prompt_len": args.prompt_len, "rows": rows,
                   "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
