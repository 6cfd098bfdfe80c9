"""Prefill-mode perplexity and prompt tokens/s with a prompt chunk's products in bfloat16 against float32, one process,
the two alternated: what multiplying in bfloat16 (backend.bf16_products, where the CPU has AVX-512 BF16 or AMX) costs
in accuracy and gains in speed.

    python scripts/dev/prefill_products.py --data WIKITEXT_TEST_TXT [--model M] [--weights bfloat16|int8] [--windows 6]

Each window of --window tokens is one forward (no cache), its logits scored at every position.
"""

import argparse
import dataclasses

import torch

from infinigen_kv.model import backend
from infinigen_kv.model.load import load_model
from weights_ppl import window_perplexity  # (this folder: on the path when a script here runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a text file (WikiText-2's test split)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--weights", default="bfloat16")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=6)
    args = ap.parse_args()
    model, tok = load_model(args.model, weights=args.weights)
    text = open(args.data, encoding="utf-8").read()[: 200 * args.window * args.windows]
    ids = torch.tensor(tok(text)["input_ids"])
    base = model.backend
    results: dict = {}
    for on in (False, True, False, True):
        model.backend = dataclasses.replace(base, bf16_products=on)
        ppl, seconds = window_perplexity(model, ids, args.window, args.windows)
        results.setdefault(on, []).append((ppl, args.windows * args.window / seconds))
    for on, runs in results.items():
        print(f"{'bfloat16' if on else 'float32 '} products: perplexity {runs[0][0]:.4f}, "
              f"tokens/s {', '.join(f'{r[1]:.1f}' for r in runs)}")


if __name__ == "__main__":
    main()
