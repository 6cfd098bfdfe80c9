"""Prefill-mode perplexity of long windows prefilled in chunks, a chunk's attention over a long past in the bfloat16
kernel (kernels/prefill.cpp) against PyTorch's float32 attention, the two alternated in one process: what the
kernel's bfloat16 products cost in accuracy and gain in prompt tokens/s.

    python scripts/dev/long_prefill_ppl.py --data WIKITEXT_TEST_TXT [--model M] [--window 8192] [--windows 2]

Each window is prefilled as `generate` prefills it (chunks of 512 into the full cache), every position's logits
scored; the perplexity counts the positions after the first LONG_PAST (where the kernel can apply).
"""

import argparse
import math
import time

import torch
import torch.nn.functional as F

import infinigen_kv as ig
from infinigen_kv.model import attention
from infinigen_kv.runtime.generation import PREFILL_CHUNK, chunks


def window_nll(model, ids: torch.Tensor, skip: int) -> tuple[float, int, float]:
    """(summed NLL of positions after `skip`, their count, seconds) of one window ids (n,) prefilled in chunks."""
    cache, nll, count, seconds = ig.make_cache("full", model), 0.0, 0, 0.0
    cache.reserve(ids.shape[0])
    for start, end in chunks(ids.shape[0], PREFILL_CHUNK):
        x = ids[start:end][None]
        t = time.perf_counter()
        logits = model(input_ids=x, attention_mask=torch.ones(1, end, dtype=torch.long),
                       position_ids=torch.arange(start, end)[None], past_key_values=cache, use_cache=True).logits[0]
        seconds += time.perf_counter() - t
        targets = ids[start + 1 : end + 1]
        logits = logits[: targets.shape[0]]
        keep = torch.arange(start, start + targets.shape[0]) >= skip
        nll += F.cross_entropy(logits[keep].float(), targets[keep], reduction="sum").item()
        count += int(keep.sum())
    return nll, count, seconds


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a text file (WikiText-2's test split)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--window", type=int, default=8192)
    ap.add_argument("--windows", type=int, default=2)
    args = ap.parse_args()
    model, tok = ig.load_model(args.model)
    text = open(args.data, encoding="utf-8").read()[: 8 * args.window * args.windows]
    ids = torch.tensor(tok(text)["input_ids"])
    default = attention.LONG_PAST
    results: dict = {}
    for i in range(args.windows):
        w = ids[i * args.window : (i + 1) * args.window]
        for name, long_past in (("kernel", default), ("float32", 10**9)):
            attention.LONG_PAST = long_past
            nll, n, s = window_nll(model, w, default)
            r = results.setdefault(name, [0.0, 0, 0.0])
            r[0], r[1], r[2] = r[0] + nll, r[1] + n, r[2] + s
            print(f"window {i} {name}: perplexity {math.exp(nll / n):.4f}, {w.shape[0] / s:.1f} tokens/s", flush=True)
    for name, (nll, n, s) in results.items():
        print(f"{name}: perplexity {math.exp(nll / n):.4f} over {n} positions, {args.windows * args.window / s:.1f} "
              f"prompt tokens/s")


if __name__ == "__main__":
    main()
