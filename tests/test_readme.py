"""The Python code of the README and of docs/python-api.md runs as written (on a tiny local checkpoint instead of the
default model and the hub id): our model with ig.generate, and a transformers model's own generate() with our cache."""

import re
from pathlib import Path

import pytest

from conftest import save_tiny

ROOT = Path(__file__).resolve().parents[1]


def blocks(page: str, section: str | None = None) -> list[str]:
    text = (ROOT / page).read_text()
    if section:
        text = text[text.index(section) :]
        text = text[: text.index("\n## ", 5)]
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_the_readme_example_runs(tmp_path):
    model_dir = save_tiny(tmp_path / "m")
    (code,) = blocks("README.md", "## Python API")
    ns = {}
    exec(code.replace("ig.load_model()", f"ig.load_model({model_dir!r})"), ns)
    assert ns["res"].tokens.shape[0] == 1 and 0 < ns["cache"].stats["fetched_fraction"] <= 1


def test_the_python_api_page_runs(tmp_path):
    pytest.importorskip("transformers")
    model_dir = save_tiny(tmp_path / "m")
    code = blocks("docs/python-api.md")
    ours = next(b for b in code if "ig.load_model()" in b)
    theirs = next(b for b in code if "infinigen_kv.hf" in b)
    ns = {}
    exec(ours.replace("ig.load_model()", f"ig.load_model({model_dir!r})"), ns)
    assert ns["res"].tokens.shape[0] == 1 and ns["logits"].shape[-1] == 256
    exec(re.sub(r'from_pretrained\("[^"]+"\)', f"from_pretrained({model_dir!r})", theirs), ns)
    assert ns["out"].shape[1] > ns["enc"].input_ids.shape[1]
