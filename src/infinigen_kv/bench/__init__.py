"""Benchmarks: task generators, the speed and accuracy harnesses, and their shared report writing."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), or what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def write_tables(result: dict, out: Path, stem: str, table: str) -> tuple[list[Path], object]:
    """Write `stem`.json and `stem`.md under out; returns the paths and pyplot (headless) for the plots, None
    without matplotlib (the `bench` extra): the tables are written, the plots skipped with one line."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    (out / f"{stem}.md").write_text(table + "\n")
    written = [out / f"{stem}.json", out / f"{stem}.md"]
    try:
        import matplotlib
    except ModuleNotFoundError:
        print("infinigen: no plots: matplotlib is not installed (pip install 'infinigen-kv[bench]')", file=sys.stderr)
        return written, None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return written, plt


def save_plot(plt, fig, ax, path: Path) -> Path:
    """Legend, layout, PNG at `path`, figure closed."""
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
