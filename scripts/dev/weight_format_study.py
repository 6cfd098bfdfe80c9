"""Which int8 format for weights? Perplexity of the model's own forward over windows of WikiText-2 (every position
scored; a weight's rounding acts on prefill and decode alike) with its linear and embedding weights in float32,
through symmetric int8 with one float32 scale per output channel (a weight row), and as `--weights int8` holds
them (llama.cpp's q8_0: a float16 scale per 32 values). Also the bytes a weight of each format takes.

    python scripts/dev/weight_format_study.py --data DIR [--model M] [--windows 4] [--window 2048]

Prints a markdown table (the source of the int8 weight format, docs/BENCHMARKS.md).
"""

import argparse
import math
from pathlib import Path

import torch

import infinigen_kv as ig
from infinigen_kv.bench.accuracy import load_text
from infinigen_kv.model import int8_rows


def per_channel(w: torch.Tensor) -> torch.Tensor:
    """w (out, in) through int8 codes with one absmax / 127 float32 scale per row."""
    scale = w.abs().amax(-1, keepdim=True) / 127
    return torch.where(scale > 0, (w / scale).round().clamp(-127, 127), 0) * scale


def q8_0(w: torch.Tensor) -> torch.Tensor:
    """w (out, in) as `--weights int8` holds it (int8_rows.pack_kv), read back."""
    return int8_rows.unpacked_kv(int8_rows.pack_kv(w), torch.float32)


@torch.inference_mode()
def perplexity(model, ids: torch.Tensor, window: int, windows: int) -> float:
    nll, count = 0.0, 0
    for i in range(windows):
        x = ids[i * window : (i + 1) * window].unsqueeze(0)
        logits = model(input_ids=x).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
        count += x.shape[1] - 1
    return math.exp(nll / count)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="folder holding wikitext-2/test.txt")
    ap.add_argument("--model", default=None)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window", type=int, default=2048)
    args = ap.parse_args()
    model, tok = ig.load_model(args.model, dtype="float32")
    ids = torch.tensor(tok(load_text(args.data))["input_ids"])
    weights = {id(p): p for name, p in model.named_parameters()
               if name in ("embed", "lm_head") or name.endswith(("wqkv.weight", "wo.weight", "w1.weight", "w2.weight"))}
    original = {k: w.detach().clone() for k, w in weights.items()}
    params = sum(w.numel() for w in original.values())
    rows = []
    for name, fake, bytes_per in (("float32", None, 4.0),
                                  ("int8, a float32 scale per output channel", per_channel,
                                   1 + 4 * sum(w.shape[0] for w in original.values()) / params),
                                  ("int8, a float16 scale per 32 values (q8_0; `--weights int8`)", q8_0,
                                   sum(w.shape[0] * int8_rows.kv_width(w.shape[1]) for w in original.values()) / params)):
        with torch.no_grad():
            for k, w in weights.items():
                w.copy_(original[k] if fake is None else fake(original[k]))
        rows.append((name, perplexity(model, ids, args.window, args.windows), bytes_per))
    base = rows[0][1]
    print(f"\n{Path(args.model or 'default model').name}: {args.windows} windows of {args.window} tokens\n")
    print("| weights | bytes a weight | perplexity | vs float32 |\n|---|---|---|---|")
    for name, ppl, b in rows:
        print(f"| {name} | {b:.4f} | {ppl:.4f} | {100 * (ppl / base - 1):+.3f}% |")


if __name__ == "__main__":
    main()
