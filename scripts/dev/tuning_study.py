"""Tuning InfiniGen's knobs on the accuracy harness: one row per variant of the defaults (alpha,
partial_ratio, GQA combination, channel rule, skew, calibration text), scored on decode-mode perplexity
(reduced windows), niah and passkey at one budget. The defaults in config.py follow this table
(docs/BENCHMARKS.md, "Tuning InfiniGen's defaults").

    python scripts/dev/tuning_study.py --data DIR [--budget 0.1] [--samples 5]
"""

import argparse
import json
import sys
from pathlib import Path

import infinigen_kv as ig
from infinigen_kv.bench.accuracy import run_accuracy

VARIANTS = {  # name -> options changed from the defaults
    "defaults": {},
    "alpha 8": {"alpha": 8.0},
    "alpha 16": {"alpha": 16.0},
    "partial_ratio 0.3": {"partial_ratio": 0.3},
    "partial_ratio 0.5": {"partial_ratio": 0.5},
    "partial_ratio 1.0 (all channels)": {"partial_ratio": 1.0},
    "gqa_combine mean": {"gqa_combine": "mean"},
    "channel_rule q (paper's code)": {"channel_rule": "q"},
    "skew svd (paper)": {"skew": "svd"},
    "calibration text pg19": {"calibration_text": "pg19/firstbook.txt"},
    "calibration text wikitext-2": {"calibration_text": "wikitext-2/test.txt"},
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="directory with wikitext-2/test.txt and pg19/firstbook.txt")
    ap.add_argument("--model", default=None)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--samples", type=int, default=8, help="prompts per generated task")
    ap.add_argument("--windows", type=int, default=4, help="ppl windows")
    ap.add_argument("--variants", default=None, help="comma-separated subset of the variant names")
    ap.add_argument("--base", default="{}", help='options under every variant, as JSON, e.g. \'{"partial_ratio": 0.5}\'')
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    args = ap.parse_args()
    model, tok = ig.load_model(args.model)
    names = args.variants.split(",") if args.variants else list(VARIANTS)
    table = {}
    full = run_accuracy(model, tok, ["full"], ["ppl"], [None], args.windows, 0, {}, data=args.data, window=1024,
                        prefix=256)["rows"][0]["value"]
    print(f"| variant of {args.base} (budget {args.budget}) | ppl (W 1024, P 256, {args.windows} windows; full {full:.2f}) "
          f"| niah-4000 | passkey-4000 | fetched |")
    print("|---|---|---|---|---|")
    for name in names:
        opts = {**json.loads(args.base), **VARIANTS[name]}
        if "calibration_text" in opts:
            opts["calibration_text"] = str(Path(args.data) / opts["calibration_text"])
        rows = run_accuracy(model, tok, ["infinigen"], ["ppl"], [args.budget], args.windows, 0, opts,
                            data=args.data, window=1024, prefix=256)["rows"]
        rows += run_accuracy(model, tok, ["infinigen"], ["niah", "passkey"], [args.budget], args.samples, 0, opts,
                             lengths=(4000,))["rows"]
        by = {r["task"]: r for r in rows}
        table[name] = rows
        ppl = by["ppl"]
        fetched = sum(r["fetched_fraction"] for r in rows) / len(rows)
        print(f"| {name} | {ppl['value']:.2f} | {by['niah-4000']['value']:.2f} | {by['passkey-4000']['value']:.2f} "
              f"| {fetched:.3f} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    sys.exit(main())
