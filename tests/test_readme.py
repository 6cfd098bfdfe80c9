"""The README's Python API runs as written (on a tiny local checkpoint instead of the default model and the hub id):
our model with ig.generate, and a transformers model's own generate() with our cache."""

import re
from pathlib import Path

import pytest

from conftest import save_tiny

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks() -> list[str]:
    text = README.read_text()
    api = text[text.index("## Python API") :]
    api = api[: api.index("\n## ", 5)]
    return re.findall(r"```python\n(.*?)```", api, re.S)


def test_the_readme_api_runs(tmp_path):
    pytest.importorskip("transformers")
    model_dir = save_tiny(tmp_path / "m")
    code = blocks()
    ours = next(b for b in code if "ig.load_model()" in b)
    theirs = next(b for b in code if "infinigen_kv.hf" in b)
    ns = {}
    exec(ours.replace("ig.load_model()", f"ig.load_model({model_dir!r})"), ns)
    assert ns["res"].tokens.shape[0] == 1 and ns["logits"].shape[-1] == 256
    exec(re.sub(r'from_pretrained\("[^"]+"\)', f"from_pretrained({model_dir!r})", theirs), ns)
    assert ns["out"].shape[1] > ns["enc"].input_ids.shape[1]
