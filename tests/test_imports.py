"""The engine imports no transformers module: `import infinigen_kv`, `infinigen generate`, `serve`, `bench speed` and
`bench accuracy` run on our model classes, our loader and the tokenizers library (transformers is the tests'
reference and the [hf] adapter's, nothing else)."""

import subprocess
import sys


from conftest import save_tiny

SCRIPT = r"""
import io, json, sys, contextlib
model_dir, out = sys.argv[1], sys.argv[2]
import infinigen_kv as ig
seen = {"import": sorted(m for m in sys.modules if m.split(".")[0] == "transformers")}
from infinigen_kv.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    assert main(["generate", "--model", model_dir, "--prompt", "the quick brown fox", "--max-new-tokens", "3"]) == 0
    seen["generate"] = sorted(m for m in sys.modules if m.split(".")[0] == "transformers")
    assert main(["bench", "speed", "--model", model_dir, "--methods", "full,infinigen", "--prompt-len", "40",
                 "--new-tokens", "2", "--repeats", "1", "--out", out + "/speed"]) == 0
    seen["bench speed"] = sorted(m for m in sys.modules if m.split(".")[0] == "transformers")
    assert main(["bench", "accuracy", "--model", model_dir, "--methods", "full", "--tasks", "passkey",
                 "--lengths", "200", "--samples", "1", "--out", out + "/acc"]) == 0
    seen["bench accuracy"] = sorted(m for m in sys.modules if m.split(".")[0] == "transformers")
try:
    from fastapi.testclient import TestClient
except ImportError:
    TestClient = None
if TestClient is not None:
    from infinigen_kv.serve import Engine
    from infinigen_kv.serve.app import create_app
    model, tok = ig.load_model(model_dir)
    engine = Engine(model, tok, "infinigen", {})
    try:
        with TestClient(create_app(engine, "tiny")) as http:
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": "the quick", "max_tokens": 2})
            assert r.status_code == 200, r.text
    finally:
        engine.close()
    seen["serve"] = sorted(m for m in sys.modules if m.split(".")[0] == "transformers")
print(json.dumps(seen))
"""


def test_the_commands_import_no_transformers(tmp_path):
    model_dir = save_tiny(tmp_path / "m")
    r = subprocess.run([sys.executable, "-c", SCRIPT, model_dir, str(tmp_path)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = __import__("json").loads(r.stdout.strip().splitlines()[-1])
    serve = {"serve"} if __import__("importlib").util.find_spec("fastapi") else set()
    assert set(seen) == {"import", "generate", "bench speed", "bench accuracy"} | serve
    assert all(not mods for mods in seen.values()), {k: v[:5] for k, v in seen.items() if v}


GGUF_SCRIPT = r"""
import io, json, sys, contextlib
from infinigen_kv.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    assert main(["generate", "--model", sys.argv[1], "--prompt", "the quick brown fox", "--max-new-tokens", "3"]) == 0
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "transformers")))
"""


def test_a_gguf_loads_without_transformers(tmp_path):
    """A GGUF's first use (its config, tokenizer and held weights built from the file, a calibration) and a later
    one import no transformers module."""
    from infinigen_kv.testing import tiny_hf
    from infinigen_kv.testing.gguf import write_gguf

    path = write_gguf(tiny_hf("qwen2"), tmp_path / "m.gguf", default="Q8_0")
    env = {**__import__("os").environ, "INFINIGEN_CACHE_DIR": str(tmp_path / "cache")}
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", GGUF_SCRIPT, path], capture_output=True, text=True, timeout=300,
                           env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        assert __import__("json").loads(r.stdout.strip().splitlines()[-1]) == []
