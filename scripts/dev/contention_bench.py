"""Decode speed alone and beside a competing process that keeps every core busy (docs/BENCHMARKS.md, "Beside
other work"): a CPU library runs beside builds, other models and test runs, and must degrade gracefully there.

For each competitor (none; another PyTorch process multiplying 1024 x 1024 matrices on its default threads;
one plain Python busy loop per core) and each setting (extra arguments for `infinigen bench speed`, and an
environment), runs `infinigen bench speed` in a fresh process (settings that act at import, such as
OMP_WAIT_POLICY, need one) and reports decode tokens/s and the ratio to the same setting alone.

    python scripts/dev/contention_bench.py --shapes 1x1024,4x4096 --settings default,threads1 --out results/busy
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

COMPETITORS = {
    "none": [],
    "torch-matmul": [[sys.executable, "-c",
                      "import torch\na = torch.randn(1024, 1024)\nwhile True:\n    b = a @ a"]],
    "busy-loops": [[sys.executable, "-c", "while True:\n    pass"]] * (os.cpu_count() or 2),
}
# name -> (extra `bench speed` arguments, extra environment)
SETTINGS = {
    "default": ([], {}),
    "threads1": (["--threads", "1"], {}),
    "fixed": (["--threads", str(os.cpu_count() or 2)], {}),  # every core, no adaptation (the old behaviour)
    "passive": (["--threads", str(os.cpu_count() or 2)], {"OMP_WAIT_POLICY": "PASSIVE"}),
    "kernels-off": ([], {"INFINIGEN_KERNELS": "0"}),
}


def run(shape: str, methods: str, setting: str, competitor: str, new_tokens: int, repeats: int) -> list[dict]:
    batch, length = shape.split("x")
    args, env = SETTINGS[setting]
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for cmd in COMPETITORS[competitor]]
    try:
        time.sleep(1.0 if procs else 0)  # the competitor is up and spinning
        cmd = [sys.executable, "-m", "infinigen_kv.cli", "bench", "speed", "--methods", methods, "--batch", batch,
               "--prompt-len", length, "--new-tokens", str(new_tokens), "--repeats", str(repeats), "--json", *args]
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             env={**os.environ, **env}, timeout=3600)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    if out.returncode != 0:
        sys.exit(f"contention_bench: {' '.join(cmd)} failed (exit {out.returncode})")
    result = json.loads(out.stdout)
    return [{"setting": setting, "competitor": competitor, "cpu": result["machine"]["cpu"],
             **{k: r[k] for k in ("method", "batch", "prompt_len", "decode_tokens_per_s", "fetched_fraction")}}
            for r in result["rows"]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1x1024,4x4096", help="batch x prompt tokens, comma-separated")
    p.add_argument("--methods", default="full,infinigen")
    p.add_argument("--settings", default="default,fixed,threads1", help=f"from {', '.join(SETTINGS)}")
    p.add_argument("--competitors", default="none,torch-matmul,busy-loops", help=f"from {', '.join(COMPETITORS)}")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="directory for busy.json and busy.md")
    a = p.parse_args()
    rows = []
    for shape in a.shapes.split(","):
        for setting in a.settings.split(","):
            for competitor in a.competitors.split(","):
                got = run(shape, a.methods, setting, competitor, a.new_tokens, a.repeats)
                rows += got
                for r in got:
                    print(f"{shape} {setting:11s} {competitor:12s} {r['method']:10s} {r['decode_tokens_per_s']:7.2f} tok/s",
                          file=sys.stderr, flush=True)
    alone = {(r["setting"], r["method"], r["batch"], r["prompt_len"]): r["decode_tokens_per_s"]
             for r in rows if r["competitor"] == "none"}
    lines = ["| shape | setting | competitor | method | decode tok/s | vs alone |", "|---|---|---|---|---|---|"]
    for r in rows:
        ref = alone.get((r["setting"], r["method"], r["batch"], r["prompt_len"]))
        r["vs_alone"] = round(r["decode_tokens_per_s"] / ref, 3) if ref else None
        lines.append(f"| B{r['batch']} x {r['prompt_len']} | {r['setting']} | {r['competitor']} | {r['method']} | "
                     f"{r['decode_tokens_per_s']:.2f} | {r['vs_alone'] if r['vs_alone'] is not None else '-'} |")
    table = "\n".join(lines)
    print(table)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "busy.json").write_text(json.dumps({"cpu": rows[0]["cpu"] if rows else None, "rows": rows}, indent=1))
        (out / "busy.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
