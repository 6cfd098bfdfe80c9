"""Decode speed alone and beside a competing process that keeps every core busy (docs/BENCHMARKS.md, "Beside
other work"): a CPU library runs beside builds, other models and test runs, and must degrade gracefully there.

For each competitor (none; another PyTorch process multiplying 1024 x 1024 matrices on its default threads;
one plain Python busy loop per core) and each setting (extra arguments for `infinigen bench speed`, and an
environment), runs `infinigen bench speed` in a fresh process (settings that act at import, such as
OMP_WAIT_POLICY, need one) and reports decode tokens/s and the ratio to the same setting alone.

    python scripts/dev/contention_bench.py --shapes 1x1024,4x4096 --settings default,threads1 --out results/busy
    python scripts/dev/contention_bench.py --generate PROMPT.txt --settings default   # a short command instead

--generate runs `infinigen generate --prompt-file PROMPT.txt --max-new-tokens N --method M --json` once per method,
as a user would (a fresh process started beside the competitor), and reports its prefill and decode speeds.
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


def beside(competitor: str, cmd: list[str], env: dict) -> dict:
    """cmd's JSON output, run in a fresh process once the competitor is up and spinning."""
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for c in COMPETITORS[competitor]]
    try:
        time.sleep(1.0 if procs else 0)
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             env={**os.environ, **env}, timeout=3600)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    if out.returncode != 0:
        sys.exit(f"contention_bench: {' '.join(cmd)} failed (exit {out.returncode})")
    return json.loads(out.stdout)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def run_generate(prompt: str, methods: str, setting: str, competitor: str, new_tokens: int) -> list[dict]:
    args, env = SETTINGS[setting]
    rows = []
    for method in methods.split(","):
        r = beside(competitor, [sys.executable, "-m", "infinigen_kv.cli", "generate", "--prompt-file", prompt,
                                "--max-new-tokens", str(new_tokens), "--method", method, "--json", *args], env)
        rows.append({"setting": setting, "competitor": competitor, "method": method, "batch": 1, "cpu": cpu_name(),
                     "prompt_len": r["prompt_tokens"], "prefill_tokens_per_s": round(r["prompt_tokens"] / r["prefill_s"], 2),
                     "decode_tokens_per_s": r["decode_tokens_per_s"]})
    return rows


def run(shape: str, methods: str, setting: str, competitor: str, new_tokens: int, repeats: int) -> list[dict]:
    batch, length = shape.split("x")
    args, env = SETTINGS[setting]
    result = beside(competitor, [sys.executable, "-m", "infinigen_kv.cli", "bench", "speed", "--methods", methods,
                                 "--batch", batch, "--prompt-len", length, "--new-tokens", str(new_tokens),
                                 "--repeats", str(repeats), "--json", *args], env)
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
    p.add_argument("--generate", default=None, metavar="PROMPT.txt", help="run `infinigen generate` on this prompt")
    a = p.parse_args()
    rows = []
    for shape in ([None] if a.generate else a.shapes.split(",")):
        for setting in a.settings.split(","):
            for competitor in a.competitors.split(","):
                got = (run_generate(a.generate, a.methods, setting, competitor, a.new_tokens) if a.generate
                       else run(shape, a.methods, setting, competitor, a.new_tokens, a.repeats))
                rows += got
                for r in got:
                    print(f"{shape or 'generate'} {setting:11s} {competitor:12s} {r['method']:10s} "
                          f"{r['decode_tokens_per_s']:7.2f} tok/s", file=sys.stderr, flush=True)
    alone = {(r["setting"], r["method"], r["batch"], r["prompt_len"]): r for r in rows if r["competitor"] == "none"}
    lines = ["| shape | setting | competitor | method | prefill tok/s (vs alone) | decode tok/s | vs alone |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = alone.get((r["setting"], r["method"], r["batch"], r["prompt_len"]))
        r["vs_alone"] = round(r["decode_tokens_per_s"] / ref["decode_tokens_per_s"], 3) if ref else None
        pre = "-"
        if "prefill_tokens_per_s" in r:
            r["prefill_vs_alone"] = round(r["prefill_tokens_per_s"] / ref["prefill_tokens_per_s"], 3) if ref else None
            pre = f"{r['prefill_tokens_per_s']:.1f} ({r['prefill_vs_alone'] if ref else '-'})"
        lines.append(f"| B{r['batch']} x {r['prompt_len']} | {r['setting']} | {r['competitor']} | {r['method']} | {pre} | "
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
