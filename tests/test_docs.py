"""The guides: the site builds strictly (no broken link or anchor, every page in the navigation), the README stays a
page a newcomer reads in minutes and its links reach real files and headings, and the architecture page names every
module."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "methods" / "index.html").exists()


def headings(page: Path) -> set[str]:
    from markdown.extensions.toc import slugify
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slugify(re.sub(r"[`*]", "", h), "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_the_readme_is_short_and_its_links_resolve():
    readme = ROOT / "README.md"
    assert readme.stat().st_size <= 12 * 1024
    links = re.findall(r"\]\(([^)#]+)(#[^)]*)?\)", readme.read_text())
    assert len(links) >= 10
    for path, anchor in links:
        if path.startswith("http"):
            continue
        target = ROOT / path
        assert target.exists(), path
        if anchor:
            assert anchor[1:] in headings(target), f"{path}{anchor}"


def test_the_architecture_page_names_every_module():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    src = ROOT / "src" / "infinigen_kv"
    missing = [str(p.relative_to(src)) for p in sorted(src.rglob("*")) if p.suffix in {".py", ".cpp", ".h"}
               and p.name != "__init__.py" and not re.search(rf"`[^`]*\b{re.escape(p.stem)}\b[^`]*`", text)]
    assert not missing, missing


def test_the_benchmarks_page_is_a_table_and_a_sentence_or_two_a_topic():
    page = ROOT / "docs" / "BENCHMARKS.md"
    lines = page.read_text().splitlines()
    assert len(lines) <= 600
    summary = lines[lines.index("## Summary"):]
    summary = summary[:next(i for i, line in enumerate(summary[1:], 1) if line.startswith("## "))]
    rows = [line for line in summary if line.startswith("| [")]
    assert len(rows) >= 10
    for row in rows:
        for cell in row.strip("|").split("|"):
            assert len(cell.strip()) <= 250, cell
        link = re.search(r"\(#([^)]+)\)", row).group(1)
        assert link in headings(page), link
    for image in re.findall(r"!\[[^]]*\]\(([^)]+)\)", page.read_text()):
        assert (page.parent / image).is_file(), image


RESULTS = ROOT / "docs" / "results"


def test_the_results_scripts_take_their_paths_from_arguments_or_the_environment(tmp_path):
    """A sitting's script names no path of the machine it ran on, and run with nothing it stops at once with a line
    saying what to supply, having written nothing."""
    scripts = sorted(RESULTS.rglob("*.sh"))
    assert len(scripts) >= 20
    for path in scripts + sorted(RESULTS.rglob("*.py")):
        text = path.read_text()
        assert not re.search(r"(?<![\w.])/(work|root|tmp)/", text), path.relative_to(ROOT)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home")}
    for i, path in enumerate(scripts):
        run = tmp_path / f"run{i}"
        run.mkdir()
        r = subprocess.run(["bash", str(path)], cwd=run, env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode != 0, path.relative_to(ROOT)
        assert re.search(r"usage|set [A-Z_]+ to", r.stderr), (path.relative_to(ROOT), r.stderr)
        assert not list(run.iterdir()), path.relative_to(ROOT)


def test_the_peer_script_says_what_to_supply(tmp_path):
    """The ik_llama.cpp bench stops at once, status 2 and one line, without its three paths or with a folder that holds
    no build of its tools, before it writes anything."""
    script = str(ROOT / "scripts" / "ik_llama_cpp_bench.sh")
    for args, says in (([], "usage: "), ([str(tmp_path), str(tmp_path / "out"), "m.gguf"], "holds no llama-bench")):
        r = subprocess.run(["bash", script, *args], cwd=tmp_path, capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert not list(tmp_path.iterdir())
