"""A method written outside the package (examples/keynorm.py): installed through an entry point it runs by name
through generate, bench accuracy, bench speed and the server; registered in a process it runs through the API, exact
at budget 1.0 and evicting what its policy ranks last."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import infinigen_kv as ig
from conftest import left_padded_batch, save_tiny
from test_exactness import step_logits

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """examples/keynorm.py installed as `pip install ./examples` installs it: the module and a dist-info naming its
    entry point, in a folder of its own (outside the package) for PYTHONPATH; and a second entry point whose module
    does not exist."""
    root = tmp_path_factory.mktemp("site")
    shutil.copy(EXAMPLES / "keynorm.py", root / "keynorm.py")
    info = root / "infinigen_keynorm-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: infinigen-keynorm\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[infinigen_kv.methods]\nkeynorm = keynorm:METHOD\n"
                                           "broken = no_such_module:METHOD\n")
    return root


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("model"), eos_never_greedy=True)


def cli(plugin, *args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(plugin), os.environ.get("PYTHONPATH", "")]),
               PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "infinigen_kv.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_an_installed_method_runs_by_name_through_every_command(plugin, model_dir, tmp_path):
    out = cli(plugin, "generate", "--model", model_dir, "--method", "keynorm", "--budget", "0.5", "--min-budget", "0",
              "--prompt", "The pass key is 12345. Remember it. " * 6, "--max-new-tokens", "6", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["method"] == "keynorm" and r["new_tokens"] == 6 and r["fetched_fraction"] < 0.75
    out = cli(plugin, "bench", "accuracy", "--model", model_dir, "--methods", "full,keynorm", "--tasks", "passkey",
              "--lengths", "160", "--samples", "1", "--budget", "0.5,32", "--new-tokens", "6", "--out",
              str(tmp_path / "acc"), "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    assert sorted((r["method"], r["budget"]) for r in rows if r["method"] == "keynorm") == [
        ("keynorm", 0.5), ("keynorm", 32)]  # a budgeted method: swept, as h2o is
    out = cli(plugin, "bench", "speed", "--model", model_dir, "--methods", "full,keynorm", "--prompt-len", "128",
              "--new-tokens", "4", "--repeats", "1", "--json")
    assert out.returncode == 0, out.stderr
    assert {r["method"] for r in json.loads(out.stdout)["rows"]} == {"full", "keynorm"}
    out = cli(plugin, "generate", "--model", model_dir, "--method", "broken", "--prompt", "hi")
    lines = [line for line in out.stderr.splitlines() if line.strip() and not line.startswith("infinigen: loaded")]
    assert out.returncode == 1 and len(lines) == 1 and "no_such_module" in lines[0], out.stderr
    out = cli(plugin, "generate", "--model", model_dir, "--method", "nosuch", "--prompt", "hi")
    assert out.returncode == 2 and "keynorm" in out.stderr  # the choices name the installed methods


def test_an_installed_method_serves(plugin, model_dir, tmp_path, monkeypatch):
    """`infinigen serve --method keynorm`: the openai client's chat completion, streamed and not, from it."""
    openai = pytest.importorskip("openai")
    from test_serve import MODEL, Server

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(plugin), os.environ.get("PYTHONPATH", "")]))
    server = Server(model_dir, tmp_path / "server.log", "--method", "keynorm", "--budget", "0.5")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        msg = [{"role": "user", "content": "The pass key is 12345. Remember it. " * 4}]
        plain = client.chat.completions.create(model=MODEL, messages=msg, max_tokens=8, temperature=0)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, messages=msg, max_tokens=8, temperature=0, stream=True))
        assert plain.choices[0].message.content == streamed and plain.usage.completion_tokens == 8
        assert "keynorm" in open(tmp_path / "server.log").read()
    finally:
        server.stop()


def test_a_method_registered_in_the_process(tiny_models, monkeypatch):
    """ig.register_method: the name through make_cache and method_names; exact at budget 1.0 (it keeps every entry);
    at a binding budget each (sequence, KV head) keeps its cap, the sinks and the smallest key norms; a built-in name
    or a bad one is refused."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import keynorm

    from infinigen_kv.methods import registry

    monkeypatch.setattr(registry, "_REGISTERED", {})  # (this test's registration does not outlive it)
    ig.register_method("keynorm-here", keynorm.METHOD)
    assert "keynorm-here" in ig.method_names() and registry.method("keynorm-here").takes_budget
    for bad in ("full", "a,b", ""):
        with pytest.raises(ValueError):
            ig.register_method(bad, keynorm.METHOD)
    for kind in ("llama-gqa", "gemma3", "opt"):
        model = tiny_models[kind]
        ids, mask = left_padded_batch(lengths=(48, 40, 31))
        ref = step_logits(model, ig.make_cache("full", model), ids, mask)
        exact = ig.make_cache("keynorm-here", model, budget=1.0)
        torch.testing.assert_close(step_logits(model, exact, ids, mask), ref, atol=1e-4, rtol=1e-4)
    model = tiny_models["llama-gqa"]
    cache = ig.make_cache("keynorm-here", model, budget=0.25, min_budget=0, sinks=2)
    ids = torch.randint(3, 256, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(ids, past_key_values=cache)
        layer = cache.layers[1]
        keys = layer.k.valid()[0].float()  # (G, 64, d): every prompt entry, before the first step evicts
        model(ids[:, -1:], past_key_values=cache, position_ids=torch.tensor([[64]]))
    kept = layer.pos.valid()[0, :, : int(layer.kept[0]), 0]  # (G, cap) positions kept
    assert kept.shape[-1] == 17  # ceil(0.25 x 65)
    for g in range(keys.shape[0]):
        prompt = [int(p) for p in kept[g] if p < 64]
        assert {0, 1} <= set(prompt)  # the sinks
        norms = keys[g].norm(dim=-1)
        rest = [p for p in range(2, 64) if p not in prompt]
        assert max(norms[p] for p in prompt if p >= 2) <= min(norms[p] for p in rest) + 1e-6
