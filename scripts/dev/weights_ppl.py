"""Prefill-mode perplexity of a model with its weights held each way (`--weights`): one forward a window of WikiText-2,
every position scored, the same windows for each. `--second-half` scores only each window's second half, as llama.cpp's
`llama-perplexity -c WINDOW --chunks WINDOWS` does (its chunks are these windows when given the text written by
`--write-text`), so the two tools' figures compare.

    python scripts/dev/weights_ppl.py --data WIKITEXT_TEST_TXT [--model M] [--weights auto,bfloat16,int8,int4] \
        [--windows 4]
"""

import argparse
import math
import time

import torch
import torch.nn.functional as F

from infinigen_kv.model.load import load_model


def window_perplexity(model, ids: torch.Tensor, window: int, windows: int, first: int = 0,
                      bos: int | None = None) -> tuple[float, float]:
    """(perplexity, seconds in the forwards) of `windows` windows of `window` tokens of ids, one forward each, the
    predictions from position `first` on scored; bos: each window's first token made this one (llama-perplexity's
    chunks of a model whose tokenizer adds BOS)."""
    nll, n, seconds = 0.0, 0, 0.0
    with torch.inference_mode():
        for i in range(windows):
            x = ids[i * window : (i + 1) * window][None].clone()
            if bos is not None:
                x[0, 0] = bos
            start = time.perf_counter()
            logits = model(x, use_cache=False).logits[0]
            seconds += time.perf_counter() - start
            nll += F.cross_entropy(logits[first:-1].float(), x[0, first + 1 :], reduction="sum").item()
            n += x.shape[1] - 1 - first
    return math.exp(nll / n), seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a text file (WikiText-2's test split)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--weights", default="auto,bfloat16,int8,int4", help="auto: a GGUF at its own precision")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--second-half", action="store_true", help="score each window's second half (llama-perplexity's)")
    ap.add_argument("--write-text", default=None, help="write the text scored to this file (for llama-perplexity -f)")
    args = ap.parse_args()
    text = open(args.data, encoding="utf-8").read()[: 200 * args.window * args.windows]
    if args.write_text:
        open(args.write_text, "w", encoding="utf-8").write(text)
    first = args.window // 2 if args.second_half else 0
    for weights in args.weights.split(","):
        model, tok = load_model(args.model, weights=weights)
        # special tokens' text read as text, as llama-perplexity reads it (WikiText's "<unk>" is Gemma's unknown token)
        tok.backend_tokenizer.encode_special_tokens = True
        ids = torch.tensor(tok(text)["input_ids"])
        bos = tok.bos_token_id if tok.bos_token_id is not None and int(ids[0]) == tok.bos_token_id else None
        ppl, _ = window_perplexity(model, ids, args.window, args.windows, first, bos)
        print(f"{weights}: perplexity {ppl:.4f}", flush=True)


if __name__ == "__main__":
    main()
