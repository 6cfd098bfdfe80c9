"""`infinigen bench accuracy`: tasks through the real decode path, every method at the same budget.

Tasks so far: `passkey` (a 5-digit key at a random depth of filler text, exact match).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ..baselines import make_cache
from ..generation import generate
from .tasks import passkey

TASKS = ("passkey",)


def run_passkey(model, tokenizer, method, options, length, samples, seed):
    """Share of `samples` passkey prompts of ~`length` tokens answered exactly, and the mean fetched fraction."""
    device = next(model.parameters()).device
    hits, fetched = 0, []
    for i in range(samples):
        s = passkey(tokenizer, length, seed=seed + i)
        enc = tokenizer(s.prompt, return_tensors="pt").to(device)
        cache = make_cache(method, model, **options)
        r = generate(model, enc["input_ids"], enc["attention_mask"], cache=cache, max_new_tokens=8)
        answer = tokenizer.decode(r.tokens[0, : r.lengths[0]], skip_special_tokens=True)
        ok = s.answer in answer
        hits += ok
        fetched.append(getattr(cache, "stats", {}).get("fetched_fraction", 1.0))
        print(f"  passkey {length} {method} seed {seed + i}: {'ok' if ok else 'miss'} {answer.strip()[:20]!r}",
              file=sys.stderr, flush=True)
    return hits / samples, sum(fetched) / len(fetched)


def run_accuracy(model, tokenizer, methods, tasks, budgets, samples, seed, options, lengths=(4000,), out=None,
                 model_name=None) -> dict:
    rows = []
    for task in tasks:
        for length in lengths:
            for budget in budgets:
                for method in methods:
                    opts = {k: v for k, v in {**options, "budget": budget, "tokenizer": tokenizer}.items()
                            if v is not None}
                    acc, fetched = run_passkey(model, tokenizer, method, opts, length, samples, seed)
                    rows.append({"task": f"{task}-{length}", "method": method, "budget": budget, "metric": "accuracy",
                                 "value": round(acc, 4), "n": samples, "fetched_fraction": round(fetched, 4)})
    result = {"model": model_name or "SmolLM2-135M-Instruct", "torch": torch.__version__, "rows": rows}
    if out:
        d = Path(out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "accuracy.json").write_text(json.dumps(result, indent=2))
        (d / "accuracy.md").write_text(markdown_table(result) + "\n")
    return result


def markdown_table(result: dict) -> str:
    lines = ["| task | method | budget | metric | value | n | fetched |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['task']} | {r['method']} | {r['budget']} | {r['metric']} | {r['value']:.3f} | {r['n']} | "
                     f"{r['fetched_fraction']:.3f} |")
    return "\n".join(lines)
