"""The engine's fixed costs and speeds against another git revision's, one sitting, runs alternated: import time and
memory (beside `import torch`), `infinigen generate --max-new-tokens 1` (startup, load time, max RSS), prefill of 16
tokens, and `bench speed` (prefill and decode at B1 / B4, max RSS), on the models and weight formats given.

    python scripts/dev/engine_ab.py --rev 21f17ed --models default,PATH/qwen.gguf --weights bfloat16,int8 \
        --prompt-len 4096 --batch 1,4 [--repeats 3] [--out DIR]

The other revision is checked out once into a worktree under /tmp and run with this checkout's virtual environment
(PYTHONPATH puts its source first). Each measurement is a fresh process; the medians are printed as a table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMPORT = "import infinigen_kv.model.load, infinigen_kv.runtime.generation, infinigen_kv.methods.infinigen"


def timed(cmd: list[str], src: Path | None) -> tuple[float, int, str]:
    """(wall seconds, max RSS bytes, stdout + stderr) of cmd under /usr/bin/time, with `src` first on the path and
    its own build of the CPU kernels (one folder a tree: torch rebuilds an extension whose source path changed)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if src is not None:
        env["PYTHONPATH"] = str(src)
        env["TORCH_EXTENSIONS_DIR"] = str(Path(tempfile.gettempdir()) / f"engine-ab-ext-{hashlib.md5(str(src).encode()).hexdigest()[:8]}")
    r = subprocess.run(["/usr/bin/time", "-f", "TIME %e %M"] + cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    wall, rss = re.findall(r"TIME ([\d.]+) (\d+)", r.stderr)[-1]
    return float(wall), int(rss) * 1024, r.stdout + r.stderr


def worktree(rev: str) -> Path:
    path = Path(tempfile.gettempdir()) / f"engine-ab-{rev}"
    if not path.is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev], check=True,
                       capture_output=True)
    return path / "src"


def cells(model: str, weights: str, args) -> dict:
    """name -> (command, how to read its figure from (wall, rss, output))."""
    py = sys.executable
    m = [] if model == "default" else ["--model", model]
    w = ["--dtype", "float32"] if weights == "float32" else ["--weights", weights]  # float32: no held weights
    gen = [py, "-m", "infinigen_kv.cli", "generate", *m, *w, "--max-new-tokens", "1", "--json"]
    out = {
        "startup_s": (gen + ["--prompt", "Hello"], lambda t, r, o: t),
        "startup_rss_mb": (gen + ["--prompt", "Hello"], lambda t, r, o: r / 2**20),
        "load_s": (gen + ["--prompt", "Hello"], lambda t, r, o: float(re.search(r"loaded .* in ([\d.]+) s", o)[1])),
        "prefill16_s": (gen + ["--prompt", " ".join(["word"] * 15)], lambda t, r, o: _json(o)["prefill_s"]),
    }
    if args.no_bench:
        return out
    bench = [py, "-m", "infinigen_kv.cli", "bench", "speed", *m, *w, "--methods", "full,infinigen",
             "--batch", args.batch, "--prompt-len", str(args.prompt_len), "--new-tokens", "16", "--repeats", "1",
             "--json", "--out", str(Path(tempfile.gettempdir()) / "engine-ab-bench")]
    for B in args.batch.split(","):
        for method in ("full", "infinigen"):
            out[f"{method}_B{B}_decode"] = (bench, lambda t, r, o, B=B, method=method: _row(o, method, B)[
                "decode_tokens_per_s"])
        out[f"prefill_B{B}_s"] = (bench, lambda t, r, o, B=B: _row(o, "full", B)["prefill_s"])
    out["bench_rss_mb"] = (bench, lambda t, r, o: r / 2**20)
    return out


def _json(text: str) -> dict:
    start = text.index("{")
    return json.JSONDecoder().raw_decode(text[start:])[0]


def _row(text: str, method: str, B: str) -> dict:
    result = _json(text)
    rows = result["results"] if "results" in result else result["rows"]
    return next(r for r in rows if r["method"] == method and str(r["batch"]) == B)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", required=True, help="the git revision to compare the working tree with")
    ap.add_argument("--models", default="default")
    ap.add_argument("--weights", default="bfloat16", help="bfloat16, int8 (held weights) or float32 (--dtype float32)")
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-bench", action="store_true", help="only the import and generate figures")
    ap.add_argument("--out", default=None, help="a folder for the raw figures (figures.json)")
    args = ap.parse_args()
    trees = {"before": worktree(args.rev), "after": ROOT / "src"}
    figures: dict = {}
    py = sys.executable
    for src in trees.values():  # each tree's kernels built (and the default model converted) before any timing
        timed([py, "-m", "infinigen_kv.cli", "generate", "--max-new-tokens", "1", "--prompt", "Hello"], src)
    for _ in range(args.repeats):  # import: each tree and torch alone, alternated
        for name, src in [("torch", None), *trees.items()]:
            code = "import torch" if name == "torch" else IMPORT
            t, r, _ = timed([py, "-c", code], src)
            figures.setdefault(("import", name, "s"), []).append(t)
            figures.setdefault(("import", name, "rss_mb"), []).append(r / 2**20)
    for model in args.models.split(","):
        for weights in args.weights.split(","):
            plan = cells(model, weights, args)
            commands = {}
            for key, (cmd, read) in plan.items():
                commands.setdefault(tuple(cmd), []).append((key, read))
            for cmd, reads in commands.items():
                for _ in range(args.repeats if "generate" in cmd else 1):
                    for tree, src in trees.items():
                        t, r, o = timed(list(cmd), src)
                        for key, read in reads:
                            figures.setdefault((f"{Path(model).name} {weights}", key, tree), []).append(read(t, r, o))
    print(f"\n| what | {' | '.join(['before', 'after', 'after / before'])} |\n|---|---|---|---|")
    keys = sorted({k[:2] for k in figures if k[0] != "import"}, key=str)
    t0, r0 = (statistics.median(figures[("import", "torch", x)]) for x in ("s", "rss_mb"))
    for tree in trees:
        t, r = (statistics.median(figures[("import", tree, x)]) for x in ("s", "rss_mb"))
        print(f"| import ({tree}) over `import torch` ({t0:.2f} s, {r0:.0f} MiB) | +{t - t0:.2f} s | +{r - r0:.0f} MiB | |")
    for what, key in keys:
        b, a = (statistics.median(figures[(what, key, tree)]) for tree in ("before", "after"))
        print(f"| {what}: {key} | {b:.3f} | {a:.3f} | {a / b:.2f}x |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "figures.json").write_text(json.dumps({" / ".join(k): v for k, v in figures.items()},
                                                                indent=1))


if __name__ == "__main__":
    main()
