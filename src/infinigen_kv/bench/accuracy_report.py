"""`bench accuracy`'s reports: the markdown table, RULER's per-task summary, accuracy.json and the plots."""

from __future__ import annotations

from pathlib import Path

from ..methods.registry import REFERENCE
from . import ruler, save_plot, write_tables


def budget_label(budget) -> str:
    """A budget as tables show it: "-" (budget-free method), a fraction (0.1), or a token count ("1024 tok")."""
    return "-" if budget is None else f"{int(budget)} tok" if budget > 1 else f"{budget:g}"


def markdown_table(result: dict) -> str:
    lines = ["| task | method | budget | metric | value | n | fetched |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['task']} | {r['method']} | {budget_label(r['budget'])} | {r['metric']} | "
                     f"{r['value']:.4g} | {r['n']} | {r['fetched_fraction']:.3f} |")
    return "\n".join(lines + [ruler_summary(result)])


def _short(task: str) -> str:
    """niah_single_1 -> s1, niah_multikey_2 -> mk2, niah_multivalue -> mv, ruler_cwe -> cwe."""
    for long, short in (("niah_single_", "s"), ("niah_multikey_", "mk"), ("niah_multivalue", "mv"),
                        ("niah_multiquery", "mq"), ("ruler_", "")):
        task = task.replace(long, short)
    return task


def ruler_summary(result: dict) -> str:
    """RULER's table per length: a row per method and budget, a column per task, their mean and the fetched
    share ("" when no RULER mean was computed)."""
    rows = result["rows"]
    cell = {(r["task"], r["method"], r["budget"]): r for r in rows}
    text = []
    for mean in dict.fromkeys(r["task"] for r in rows if r["task"].startswith("ruler-mean-")):
        length = mean.removeprefix("ruler-mean-")
        tasks = [t for t in dict.fromkeys(r["task"] for r in rows) if t.removesuffix(f"-{length}") in ruler.TASKS]
        names = [_short(t.removesuffix(f"-{length}")) for t in tasks]
        text += ["", f"RULER at {length} tokens (fetched: mean share of the past fetched per step)", "",
                 "| method | budget | " + " | ".join(names) + " | **mean** | fetched | n |",
                 "|---|---|" + "---|" * (len(names) + 3)]
        for r in rows:
            if r["task"] == mean:
                scores = " | ".join(f"{cell[(t, r['method'], r['budget'])]['value']:.2f}" for t in tasks)
                text.append(f"| {r['method']} | {budget_label(r['budget'])} | {scores} | **{r['value']:.3f}** | "
                            f"{r['fetched_fraction']:.3f} | {r['n']} |")
    return "\n".join(text)


def write_reports(result: dict, out: Path) -> list[Path]:
    """accuracy.json, accuracy.md and PNGs per (task, metric): value vs budget, a line per method, one plot for
    the fraction budgets and one (`-tokens`) for the token-count budgets, each only where a method's line has two
    points or more (a single budget is a table's cell, not a plot); RULER's tasks in one plot of their mean (each
    task's figures are in the tables)."""
    written, plt = write_tables(result, out, "accuracy", markdown_table(result))
    if plt is None:
        return written
    every = {r["budget"] for r in result["rows"] if r["budget"] is not None}
    kinds = {"": sorted(b for b in every if b <= 1), "-tokens": sorted(b for b in every if b > 1)}
    for task, metric in dict.fromkeys((r["task"], r["metric"]) for r in result["rows"]):
        if task.rsplit("-", 1)[0] in ruler.TASKS:  # one of RULER's: drawn as part of its mean
            continue
        for suffix, budgets in kinds.items():
            lines = {}  # method -> [(budget or None, value)]
            for r in result["rows"]:
                if r["task"] == task and r["metric"] == metric and (r["budget"] is None or r["budget"] in budgets):
                    lines.setdefault(r["method"], []).append((r["budget"], r["value"]))
            if max((len(pts) for pts in lines.values() if pts[0][0] is not None), default=0) < 2:
                continue  # no line of two points: the table says it
            fig, ax = plt.subplots(figsize=(5, 3.5))
            for method, pts in lines.items():
                if pts[0][0] is None:  # budget-independent method: a horizontal reference line
                    ax.axhline(pts[0][1], linestyle="--", label=method, color="gray" if method == REFERENCE else None)
                else:
                    pts.sort()
                    ax.plot([b for b, _ in pts], [v for _, v in pts], marker="o", label=method)
            ax.set_xlabel("budget (tokens per sequence, head and layer)" if suffix else "budget (fraction of the past)")
            ax.set_ylabel(metric)
            ax.set_title(task)
            ax.set_xticks(budgets)
            if suffix:
                ax.set_xscale("log", base=2)
                ax.set_xticks(budgets, [str(int(b)) for b in budgets])
            written.append(save_plot(plt, fig, ax, out / f"{task}-{metric}{suffix}.png"))
    return written
