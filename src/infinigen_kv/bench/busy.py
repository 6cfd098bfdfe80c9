"""Speed beside other work (`infinigen bench busy`): a CPU library runs beside builds, other models and test runs,
and must degrade gracefully there. For each competitor that keeps every core busy (another PyTorch process
multiplying 1024 x 1024 matrices on its default threads; one Python busy loop per core) and each thread setting,
a fresh process of `infinigen bench speed` (or, with `generate`, of `infinigen generate` on a prompt file, as a
user runs it) is started once the competitor spins; its prefill and decode speeds are reported against the same
setting alone. A fresh process each time: the threads a command starts on, and settings read at import
(OMP_WAIT_POLICY), are part of what is measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from . import cpu_name

COMPETITORS = {
    "none": [],
    "torch-matmul": [[sys.executable, "-c", "import torch\na = torch.randn(1024, 1024)\nwhile True:\n    b = a @ a"]],
    "busy-loops": [[sys.executable, "-c", "while True:\n    pass"]] * (os.cpu_count() or 2),
}
# name -> (extra command arguments, extra environment)
SETTINGS = {
    "default": ([], {}),  # threads from the machine's load
    "threads1": (["--threads", "1"], {}),
    "fixed": (["--threads", str(os.cpu_count() or 2)], {}),  # every core, no adaptation
    "passive": (["--threads", str(os.cpu_count() or 2)], {"OMP_WAIT_POLICY": "PASSIVE"}),
    "kernels-off": ([], {"INFINIGEN_KERNELS": "0"}),
}


class BusyError(RuntimeError):
    """A measured command failed."""


def beside(competitor: str, cmd: list[str], env: dict, timeout: float = 3600) -> dict:
    """cmd's JSON output, cmd run in a fresh process once the competitor's processes are up and spinning."""
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for c in COMPETITORS[competitor]]
    try:
        time.sleep(1.0 if procs else 0)
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, **env}, timeout=timeout)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no message"])[-1]
        raise BusyError(f"`{' '.join(cmd[2:])}` failed beside {competitor} (exit {out.returncode}): {last}")
    return json.loads(out.stdout)


def _command(kind: list[str], model: str | None, setting: str) -> tuple[list[str], dict]:
    args, env = SETTINGS[setting]
    return [sys.executable, "-m", "infinigen_kv.cli", *kind, *(["--model", model] if model else []), "--json",
            *args], env


def measure(shape: tuple[int, int] | None, methods: list[str], setting: str, competitor: str, new_tokens: int,
            repeats: int, model: str | None = None, prompt_file: str | None = None) -> list[dict]:
    """One (shape, setting, competitor) cell, a row per method: `bench speed` at shape (batch, prompt tokens), or
    `generate` on prompt_file (batch 1) once per method."""
    rows = []
    if prompt_file is not None:
        for method in methods:
            cmd, env = _command(["generate", "--prompt-file", prompt_file, "--max-new-tokens", str(new_tokens),
                                 "--method", method], model, setting)
            r = beside(competitor, cmd, env)
            rows.append({"method": method, "batch": 1, "prompt_len": r["prompt_tokens"],
                         "prefill_tokens_per_s": round(r["prompt_tokens"] / max(r["prefill_s"], 1e-9), 2),
                         "decode_tokens_per_s": r["decode_tokens_per_s"]})
    else:
        cmd, env = _command(["bench", "speed", "--methods", ",".join(methods), "--batch", str(shape[0]),
                             "--prompt-len", str(shape[1]), "--new-tokens", str(new_tokens), "--repeats",
                             str(repeats)], model, setting)
        rows = [{**{k: r[k] for k in ("method", "batch", "prompt_len", "decode_tokens_per_s")},
                 "prefill_tokens_per_s": round(r["batch"] * r["prompt_len"] / max(r["prefill_s"], 1e-9), 2)}
                for r in beside(competitor, cmd, env)["rows"]]
    return [{"setting": setting, "competitor": competitor, **r} for r in rows]


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row's speeds over the same (setting, method, shape) with no competitor, where that was measured."""
    alone = {(r["setting"], r["method"], r["batch"], r["prompt_len"]): r for r in rows if r["competitor"] == "none"}
    for r in rows:
        ref = alone.get((r["setting"], r["method"], r["batch"], r["prompt_len"]))
        for key in ("decode_tokens_per_s", "prefill_tokens_per_s"):
            if key in r:
                r[key.replace("tokens_per_s", "vs_alone")] = round(r[key] / ref[key], 3) if ref else None
    return rows


def markdown_table(result: dict) -> str:
    def cell(r, key):
        if key not in r:
            return "-"
        ratio = r.get(key.replace("tokens_per_s", "vs_alone"))
        return f"{r[key]:.2f}" + (f" ({ratio:.2f}x)" if ratio is not None else "")

    lines = ["| shape | setting | competitor | method | prefill tok/s (vs alone) | decode tok/s (vs alone) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| B{r['batch']} x {r['prompt_len']} | {r['setting']} | {r['competitor']} | {r['method']} | "
              f"{cell(r, 'prefill_tokens_per_s')} | {cell(r, 'decode_tokens_per_s')} |" for r in result["rows"]]
    return "\n".join(lines)


def run_busy(shapes: list[tuple[int, int]], methods: list[str], settings: list[str], competitors: list[str],
             new_tokens: int, repeats: int, model: str | None = None, prompt_file: str | None = None,
             out: str | None = None) -> dict:
    rows = []
    for shape in [None] if prompt_file else shapes:
        for setting in settings:
            for competitor in competitors:
                got = measure(shape, methods, setting, competitor, new_tokens, repeats, model, prompt_file)
                rows += got
                for r in got:
                    print(f"busy: {'generate' if prompt_file else 'B%d x %d' % shape} {setting} {competitor} "
                          f"{r['method']}: {r['decode_tokens_per_s']:.2f} tok/s", file=sys.stderr, flush=True)
    machine = {"cpu": cpu_name(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
    result = {"benchmark": "busy", "machine": machine, "model": model, "rows": with_ratios(rows)}
    if out:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        (path / "busy.json").write_text(json.dumps(result, indent=1))
        (path / "busy.md").write_text(markdown_table(result) + "\n")
    return result
