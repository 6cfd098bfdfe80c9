"""lm-evaluation-harness adapter on a tiny local JSON task (log-likelihood and generation)."""

import json

import pytest

pytest.importorskip("lm_eval")

from infinigen_kv.bench.lmeval import run_lmeval  # noqa: E402
from test_cli import save_tiny  # noqa: E402

MC = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
"""

GEN = """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import infinigen_kv as ig

    return ig.load_model(save_tiny(tmp_path_factory.mktemp("lmeval-model")))


def test_local_json_tasks_with_each_method(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "tiny.jsonl"
    docs = [{"question": f"The quick brown fox number {i}", "choices": [" jumps", " sleeps"], "label": i % 2,
             "answer": " jumps"} for i in range(4)]
    data.write_text("\n".join(json.dumps(d) for d in docs))
    (tmp_path / "tiny_mc.yaml").write_text(MC.format(path=data))
    (tmp_path / "tiny_gen.yaml").write_text(GEN.format(path=data))
    model, tok = tiny
    results = {}
    for method in ("full", "infinigen"):
        opts = {"alpha": 1e9, "budget": 1.0} if method == "infinigen" else {}
        rows = run_lmeval(model, tok, method, opts, ["tiny_mc", "tiny_gen"], include_path=str(tmp_path))
        results[method] = {(r["task"], r["metric"]): r["value"] for r in rows}
        assert ("lmeval:tiny_mc", "acc") in results[method] and ("lmeval:tiny_gen", "exact_match") in results[method]
        assert all(r["n"] == 4 for r in rows)
    assert results["full"] == results["infinigen"]  # exact settings: the same scores through the decode path


def test_bench_accuracy_lmeval_task(tiny, tmp_path, monkeypatch, capsys):
    from infinigen_kv.cli import main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = tmp_path / "tiny.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"Fox {i}", "choices": [" a", " b"], "label": 0})
                              for i in range(3)))
    (tmp_path / "tiny_mc.yaml").write_text(MC.format(path=data))
    model_dir = save_tiny(tmp_path / "model")
    assert main(["bench", "accuracy", "--model", model_dir, "--tasks", "lmeval", "--lmeval-tasks", "tiny_mc",
                 "--lmeval-include", str(tmp_path), "--methods", "full,streaming", "--budget", "0.5", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["task"], r["method"], r["budget"], r["metric"]) for r in rows] == [
        ("lmeval:tiny_mc", "full", None, "acc"), ("lmeval:tiny_mc", "streaming", 0.5, "acc")]
