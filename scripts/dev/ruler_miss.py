"""Why does InfiniGen miss a RULER sample the full cache gets? Prefill the prompt once; decode it with the
full cache, with InfiniGen at `--budget` (recall diagnostic on: the share of each layer's true attention mass
on the entries it fetched), and with InfiniGen with one layer at a time attending densely. The layers whose
dense attention alone recovers the full cache's score are where the speculation loses the answer.

    python scripts/dev/ruler_miss.py --task niah_single_2 --length 8000 --seed 0 --budget 0.1 --data DIR

Prints the outputs, the per-layer recall and those layers (docs/BENCHMARKS.md, "RULER at 8k").
"""

import argparse

import infinigen_kv as ig
from infinigen_kv.methods.registry import make_cache
from infinigen_kv.bench import accuracy, ruler
from infinigen_kv.cli import _budget
from infinigen_kv.runtime.generation import generate, prefill
from infinigen_kv.bench.tee import TeeCache


def decode(model, tokenizer, ids, cache, logits, max_new, scorer, dense=()):
    for layer in dense:  # attends over all of its cache, as layer 0 does
        cache.layers[layer].dense = True
    r = generate(model, ids, cache=cache, max_new_tokens=max_new, prefilled=logits)
    out = tokenizer.decode(r.tokens[0, : r.lengths[0]], skip_special_tokens=True)
    return scorer(out), out


def ruler_prompt(p: argparse.ArgumentParser, args) -> tuple:
    """The model of args.model and the prompt of args.task / length / seed: (model, tokenizer, ids (1, n), answers,
    max_new, scorer); a missing haystack text is the parser's error."""
    try:
        essay = accuracy.load_essay(args.data) if args.task in ruler.NEEDS_ESSAY else None
    except accuracy.DataError as e:
        p.error(str(e))
    model, tokenizer = ig.load_model(args.model)
    prompt, answers, max_new, scorer = accuracy.make_prompt(tokenizer, args.task, args.length, args.seed, essay)
    return model, tokenizer, tokenizer(prompt, return_tensors="pt")["input_ids"], answers, max_new, scorer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="niah_single_2", choices=ruler.TASKS)
    p.add_argument("--length", type=int, default=8000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=_budget, default=0.1, help="a fraction (0.1) or a token count (1024)")
    p.add_argument("--model", default=None)
    p.add_argument("--data", default=None, help="text for the essay haystacks (a folder with pg19/ inside)")
    args = p.parse_args()

    model, tokenizer, ids, answers, max_new, scorer = ruler_prompt(p, args)
    full, spec = make_cache("full", model), make_cache("infinigen", model, budget=args.budget, min_budget=0)  # as the bench
    logits = prefill(model, ids, None, TeeCache([full, spec]), max_new)

    ref = decode(model, tokenizer, ids, full, logits, max_new, scorer)
    run = spec.fork()
    run.track_recall = True
    got = decode(model, tokenizer, ids, run, logits, max_new, scorer)
    recall = run.stats["recall_per_layer"]
    speculated = [i for i, layer in enumerate(run.layers) if recall[i] is not None]  # all but the dense layers
    print(f"{args.task} at {args.length} tokens, seed {args.seed}, answer {answers}")
    for name, (score, out) in (("full", ref), (f"infinigen {args.budget:g}", got)):
        print(f"{name + ':':16s} score {score:.2f} {out[:60]!r}")
    print("recall per speculated layer (share of the true attention mass fetched; the others are dense):")
    print("  " + " ".join(f"{i}:{recall[i]:.3f}" for i in speculated))
    lowest = sorted(speculated, key=recall.__getitem__)[:3]
    print("  lowest: " + ", ".join(f"layer {i} {recall[i]:.3f}" for i in lowest))
    if got[0] >= ref[0]:
        print("InfiniGen scores as the full cache does here: nothing to locate.")
        return
    fixes = []
    for layer in speculated:
        score, out = decode(model, tokenizer, ids, spec.fork(), logits, max_new, scorer, dense=[layer])
        if score >= ref[0]:
            fixes.append(layer)
            print(f"layer {layer} dense: score {score:.2f} {out[:60]!r}")
    print(f"layers whose dense attention alone recovers the full cache's score: {fixes or 'none'}")


if __name__ == "__main__":
    main()
