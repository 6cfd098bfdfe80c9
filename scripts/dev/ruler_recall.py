"""Where does a selection lose a RULER sample? One prefill of the prompt, shared by the full cache and by each
method that selects from a pool (InfiniGen at each speculation input, `--from previous,own`; quest, shadowkv) at each
budget; each decodes greedily with the recall diagnostic on. Prints each one's output and score, and per speculated layer: the share of the true attention mass
on the fetched rows (mass), the share of each query head's true top-k it fetched (k = the rows it fetched; the mean
over heads and the worst head), and the heads worst recalled over all layers.

    python scripts/dev/ruler_recall.py --task niah_multivalue --length 16000 --seed 1 --budget 0.05,0.1 \\
        [--methods infinigen,quest,shadowkv] --model MODEL --data DIR

(docs/BENCHMARKS.md, "RULER at 16k tokens, the 0.5B").
"""

import argparse
import dataclasses

from infinigen_kv.bench import ruler
from infinigen_kv.bench.tee import TeeCache
from infinigen_kv.cli import _budget
from infinigen_kv.methods.registry import make_cache
from infinigen_kv.runtime.generation import generate, prefill
from ruler_miss import ruler_prompt  # scripts/dev/ is on the path when run as a script


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="niah_multivalue", choices=ruler.TASKS)
    p.add_argument("--length", type=int, default=16000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", default="0.05", help="budgets, comma-separated: fractions (0.05) or token counts (1024)")
    p.add_argument("--from", dest="sources", default="previous,own", help="InfiniGen's speculation inputs, comma-separated")
    p.add_argument("--methods", default="infinigen", help="methods that select from the pool, comma-separated")
    p.add_argument("--model", default=None)
    p.add_argument("--data", default=None, help="text for the essay haystacks (a folder with pg19/ inside)")
    p.add_argument("--worst", type=int, default=8, help="how many of the worst (layer, head) pairs to list")
    args = p.parse_args()
    budgets = [_budget(b) for b in args.budget.split(",")]
    sources = args.sources.split(",")

    model, tokenizer, ids, answers, max_new, scorer = ruler_prompt(p, args)
    full = make_cache("full", model)
    methods = args.methods.split(",")
    # as the bench: each budget as named
    selecting = {m: make_cache(m, model, budget=budgets[0], min_budget=0) for m in methods}
    logits = prefill(model, ids, None, TeeCache([full, *selecting.values()]), max_new)
    print(f"{args.task} at {ids.shape[1]} tokens, seed {args.seed}, answer {answers}")

    def decode(cache):
        r = generate(model, ids, cache=cache, max_new_tokens=max_new, prefilled=logits)
        out = tokenizer.decode(r.tokens[0, : r.lengths[0]], skip_special_tokens=True)
        return scorer(out), out

    score, out = decode(full)
    print(f"{'full':24s} score {score:.2f} {out[:70]!r}")
    runs = [(m, source) for m in methods for source in (sources if m == "infinigen" else [""])]
    for budget in budgets:
        for method, source in runs:
            run = selecting[method].fork(budget=budget)
            if source:
                run.config = dataclasses.replace(run.config, speculate_from=source)
            run.track_recall = True
            score, out = decode(run)
            stats = run.stats
            name = f"{method} {budget:g} {source}"
            print(f"{name:24s} score {score:.2f} {out[:70]!r}  fetched {stats['fetched_fraction']:.3f}")
            mass, topk = stats["recall_per_layer"], stats["topk_recall_per_head"]
            layers = [i for i, t in enumerate(topk) if t is not None]  # the layers that selected
            print("  layer: mass  top-k mean / worst head")
            print("  " + "  ".join(f"{i}:{mass[i]:.3f} {sum(topk[i]) / len(topk[i]):.2f}/{min(topk[i]):.2f}h"
                                   f"{topk[i].index(min(topk[i]))}" for i in layers))
            pairs = sorted((topk[i][h], i, h) for i in layers for h in range(len(topk[i])))[:args.worst]
            print("  worst (layer, head) top-k recall: " + ", ".join(f"({i},{h}) {v:.2f}" for v, i, h in pairs))


if __name__ == "__main__":
    main()
