"""The engine imports no transformers module: `import infinigen_kv`, `infinigen generate`, `serve`, `bench speed` and
`bench accuracy` run on our model classes, our loader and the tokenizers library (transformers is the tests'
reference and a GGUF's one-time conversion, nothing else)."""

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
