"""scripts/plots.py: the benchmarks page's plots drawn from the results' files, and drawn again whenever those
files change (docs/img/plots.json records each plot's inputs by sha256)."""

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def plots():
    spec = importlib.util.spec_from_file_location("plots", ROOT / "scripts" / "plots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_plots_read_the_figures_the_page_quotes():
    p = plots()
    lines, used = p.decode_points(p.DECODE)
    assert dict(lines["llama.cpp (same GGUF)"]) == {1024: 22.10, 2048: 20.91, 4096: 14.30, 8192: 9.83, 16384: 6.14}
    assert dict(lines["infinigen (ours)"])[16384] == 14.6  # its better flash-attention setting, ours at the defaults
    assert all(len(pts) >= 2 for pts in lines.values())
    ruler, full, length = p.ruler_points(p.RULER)
    assert (full, length) == (0.5803, "16000")
    assert dict(ruler["infinigen"])[0.02] == pytest.approx(0.563)
    assert set(ruler) == {"infinigen", "quest", "shadowkv", "snapkv", "h2o", "streaming"}
    parts = p.step_parts(p.PROFILE)
    assert [name for name, _ in parts["infinigen"][1]] == ["speculation", "attention", "view (pool append, fetch)",
                                                           "the rest (linears, norms, Python)"]
    assert sum(ms for _, ms in parts["full"][1]) == pytest.approx(92.2)  # the parts add up to the median step


def test_the_plots_are_drawn_and_match_the_results_as_they_are(tmp_path):
    pytest.importorskip("matplotlib")
    p = plots()
    assert p.main(["--out", str(tmp_path)]) == 0
    for name in ("decode-vs-context.png", "ruler-05b-16k-methods.png", "step-breakdown.png"):
        assert (tmp_path / name).stat().st_size > 10_000, name
    drawn = json.loads((tmp_path / "plots.json").read_text())
    committed = json.loads((ROOT / "docs" / "img" / "plots.json").read_text())
    assert drawn == committed, "a result changed: run python scripts/plots.py and commit docs/img"
    for inputs in committed.values():
        for path, sha in inputs.items():
            assert hashlib.sha256((ROOT / path).read_bytes()).hexdigest() == sha, path


def test_a_missing_input_is_one_line_and_status_2(tmp_path, capsys):
    assert plots().main(["--ruler", str(tmp_path / "none.json"), "--out", str(tmp_path)]) == 2
    assert "none.json not found" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
