"""The benchmarks page's plots, drawn from the results' files (run it again when they change):

  decode-vs-context.png      decode tokens/s against context at batch 1, ours and llama.cpp's on the same GGUF,
                             one sitting (options_ab.py's tables and llama-bench's, from one folder)
  ruler-05b-16k-methods.png  RULER's mean score against the budget, a line per method (bench accuracy's JSON)
  step-breakdown.png         where a decode step's time goes, full against infinigen (profile_decode.py's output)

    python scripts/plots.py [--decode DIR] [--ruler accuracy.json] [--profile FILE] [--out docs/img]

Each plot's inputs and their sha256 go to OUT/plots.json, which the tests compare with the files as they are: a
result changed without its plot redrawn fails them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
DECODE = RESULTS / "decode-context-2026-12-02"  # the 0.5B's Q4_K_M at its own precision, AMD EPYC (Zen 3)
RULER = RESULTS / "methods-2026-12-02" / "ruler-16k" / "accuracy.json"
PROFILE = RESULTS / "long-32k-2026-11-28" / "profile_b1_32k.txt"


def decode_points(folder: Path) -> tuple[dict[str, list[tuple[int, float]]], list[Path]]:
    """({line label: [(context, decode tok/s)]}, the files read) at batch 1: each options_ab table's configs (`B=1
    n=N`; a second run of a context, `*again*`, left out) and llama-bench's `tg @ dN` rows, its better
    flash-attention setting."""
    lines: dict[str, dict[int, float]] = {}
    used = []
    for path in sorted(folder.glob("options_ab*.txt")):
        text = path.read_text()
        head = re.search(r"B=(\d+) n=(\d+)", text)
        if "again" in path.name or not head or head.group(1) != "1":
            continue
        used.append(path)
        for config, tok_s in re.findall(r"^\| (\S+) \| [^|]+ \| [\d.]+ \| ([\d.]+) \|", text, re.M):
            method, _, options = config.partition(":")
            label = f"{method} (ours{', ' + options if options else ''})"
            lines.setdefault(label, {})[int(head.group(2))] = float(tok_s)
    for path in sorted(folder.glob("llama-bench*.txt")):
        used.append(path)
        for depth, tok_s in re.findall(r"tg\d+ @ d(\d+) \|\s+([\d.]+)", path.read_text()):
            best = lines.setdefault("llama.cpp (same GGUF)", {})
            best[int(depth)] = max(best.get(int(depth), 0.0), float(tok_s))
    return {label: sorted(pts.items()) for label, pts in lines.items()}, used


def ruler_points(path: Path) -> tuple[dict[str, list[tuple[float, float]]], float | None, str]:
    """({method: [(fraction budget, mean score)]}, full's mean, the length): bench accuracy's `ruler-mean-N` rows;
    token-count budgets are the table's, not this plot's."""
    rows = [r for r in json.loads(path.read_text())["rows"] if r["task"].startswith("ruler-mean-")]
    lines: dict[str, list[tuple[float, float]]] = {}
    full = None
    for r in rows:
        if r["budget"] is None:
            full = r["value"]
        elif r["budget"] <= 1:
            lines.setdefault(r["method"], []).append((r["budget"], r["value"]))
    length = rows[0]["task"].removeprefix("ruler-mean-") if rows else "?"
    return {m: sorted(pts) for m, pts in lines.items()}, full, length


def step_parts(path: Path) -> dict[str, tuple[str, list[tuple[str, float]]]]:
    """{method: (its shape, [(part, ms a step)])} from profile_decode.py's output: the parts it times at the top
    level (those inside another are left out), then the rest of the median step (linears, norms, Python)."""
    out: dict[str, tuple[str, list[tuple[str, float]]]] = {}
    method = None
    for line in path.read_text().splitlines():
        step = re.match(r"^(\w+): median step ([\d.]+) ms \((.*)\)", line)
        part = re.match(r"^  (\S[^:]*): ([\d.]+) ms/step", line)
        if step:
            method, total = step.group(1), float(step.group(2))
            out[method] = (step.group(3), [("the rest (linears, norms, Python)", total)])
        elif part and method:
            parts = out[method][1]
            parts.insert(-1, (part.group(1), float(part.group(2))))
            parts[-1] = (parts[-1][0], parts[-1][1] - float(part.group(2)))
    return out


def _machine(folder: Path) -> str:
    """", CPU" from a sitting's start.txt (lscpu's model name), or nothing."""
    start = folder / "start.txt"
    found = re.search(r"Model name:\s*(.+)", start.read_text()) if start.exists() else None
    return f", {found.group(1).strip()}" if found else ""


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def draw(decode: Path, ruler: Path, profile: Path, out: Path) -> dict:
    """The three PNGs under `out`; returns what plots.json records (each plot's inputs and their sha256)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from infinigen_kv.bench import save_plot

    out.mkdir(parents=True, exist_ok=True)
    record = {}

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    lines, used = decode_points(decode)
    for label, pts in lines.items():
        ax.plot([n for n, _ in pts], [v for _, v in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    contexts = sorted({n for pts in lines.values() for n, _ in pts})
    ax.set_xticks(contexts, [f"{n // 1024}k" if n >= 1024 else str(n) for n in contexts])
    ax.set_xlabel("context (tokens), batch 1")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Decode against context, the same GGUF{_machine(decode)}", fontsize=10)
    save_plot(plt, fig, ax, out / "decode-vs-context.png")
    record["decode-vs-context.png"] = {_rel(p): _sha(p) for p in used + [decode / "start.txt"] if p.exists()}

    lines, full, length = ruler_points(ruler)
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    if full is not None:
        ax.axhline(full, linestyle="--", color="gray", label="full")
    for method, pts in lines.items():
        ax.plot([b * 100 for b, _ in pts], [v for _, v in pts], marker="o", label=method)
    ax.set_xscale("log")
    budgets = sorted({b for pts in lines.values() for b, _ in pts})
    ax.set_xticks([b * 100 for b in budgets], [f"{b * 100:g}%" for b in budgets])
    ax.set_xlabel("budget (share of the past per head and layer)")
    ax.set_ylabel(f"RULER mean score, {length} tokens")
    save_plot(plt, fig, ax, out / "ruler-05b-16k-methods.png")
    record["ruler-05b-16k-methods.png"] = {_rel(ruler): _sha(ruler)}

    parts = step_parts(profile)
    fig, ax = plt.subplots(figsize=(6, 2.6))
    colors, labelled = {}, set()
    for method, (_, ps) in parts.items():
        left = 0.0
        for name, ms in ps:
            color = colors.setdefault(name, f"C{len(colors)}")
            ax.barh(method, ms, left=left, color=color, label=None if name in labelled else name)
            labelled.add(name)
            left += ms
    ax.set_xlabel(f"ms a decode step ({next(iter(parts.values()))[0]})" if parts else "ms a decode step")
    ax.invert_yaxis()
    save_plot(plt, fig, ax, out / "step-breakdown.png")
    record["step-breakdown.png"] = {_rel(profile): _sha(profile)}

    (out / "plots.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode", type=Path, default=DECODE, help="a sitting's folder: options_ab*.txt, llama-bench*.txt")
    ap.add_argument("--ruler", type=Path, default=RULER, help="bench accuracy's accuracy.json with RULER's means")
    ap.add_argument("--profile", type=Path, default=PROFILE, help="profile_decode.py's output")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = ap.parse_args(argv)
    for path in (args.decode, args.ruler, args.profile):
        if not path.exists():
            print(f"plots: {path} not found", file=sys.stderr)
            return 2
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        print("plots: matplotlib is not installed (pip install 'infinigen-kv[bench]')", file=sys.stderr)
        return 2
    for name in draw(args.decode, args.ruler, args.profile, args.out):
        print(args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
