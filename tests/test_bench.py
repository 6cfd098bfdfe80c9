"""Task generators (deterministic, answer in the prompt) and the bench commands on a tiny model."""

import json

import pytest

import torch

from infinigen_kv.bench import tasks
from infinigen_kv.bench.accuracy import agreement
from test_cli import cli, one_line_error, save_tiny


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(save_tiny(tmp_path_factory.mktemp("tok")))


@pytest.mark.parametrize("task", ["passkey", "niah", "vt"])
def test_generators_deterministic_answer_in_prompt(tok, task):
    make = tasks.GENERATORS[task]
    a, b, c = make(tok, 1500, seed=3), make(tok, 1500, seed=3), make(tok, 1500, seed=4)
    assert a == b and a != c
    for s in (a, c):
        for part in s.answer.split():
            assert part in s.prompt
        n = len(tok(s.prompt)["input_ids"])
        assert 1350 < n < 1650, n  # about the asked length
        assert tasks.score(task, " " + s.answer, s.answer) == 1.0
        assert tasks.score(task, " nothing", s.answer) == 0.0


def test_vt_chain_in_order_and_partial_score(tok):
    s = tasks.variable_tracking(tok, 500, seed=1, hops=3)
    names = s.answer.split()
    where = [s.prompt.index(f"VAR {n} =") for n in names]
    assert where == sorted(where)  # the chain is assigned in order
    assert tasks.score("vt", " ".join(names[:2]), s.answer) == 0.5


def test_agreement_metric():
    ref = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    assert agreement(ref.clone(), ref) == (1.0, 1.0)
    out = torch.tensor([1, 2, 3, 9, 5, 6, 7, 0])
    assert agreement(out, ref) == (3 / 8, 6 / 8)


def test_bench_accuracy_contract_and_files(tmp_path, capsys):
    from infinigen_kv.cli import main

    model_dir = save_tiny(tmp_path / "model")
    text = tmp_path / "text.txt"
    text.write_text(tasks.FILLER * 200)
    out = tmp_path / "results"
    assert main(["bench", "accuracy", "--model", model_dir, "--methods", "full,infinigen,h2o,streaming,quant",
                 "--tasks", "ppl,passkey,niah,vt,agreement", "--budget", "0.2,32", "--lengths", "160",
                 "--samples", "1", "--window", "64", "--prefix", "24", "--new-tokens", "6", "--data", str(text),
                 "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = result["rows"]
    for r in rows:
        assert set(r) >= {"task", "method", "budget", "metric", "value", "n"}
    # budgeted methods at both budgets, the others once
    ppl = [(r["method"], r["budget"]) for r in rows if r["task"] == "ppl"]
    assert sorted(ppl, key=str) == sorted([("full", None), ("quant", None)] + [
        (m, b) for m in ("infinigen", "h2o", "streaming") for b in (0.2, 32)], key=str)  # a fraction, a token count
    assert {r["task"] for r in rows} == {"ppl", "passkey-160", "niah-160", "vt-160", "agreement-160"}
    full_agree = [r["value"] for r in rows if r["task"] == "agreement-160" and r["method"] == "full"]
    assert full_agree == [1.0, 1.0]  # the reference agrees with itself
    assert all(r["value"] > 1 for r in rows if r["metric"] == "perplexity")
    for name in ("accuracy.json", "accuracy.md", "ppl-perplexity.png", "passkey-160-accuracy.png",
                 "agreement-160-agreement_prefix.png", "ppl-perplexity-tokens.png"):
        assert (out / name).is_file(), name
    assert "| 32 tok |" in (out / "accuracy.md").read_text()


def test_bench_accuracy_needs_data():
    one_line_error(cli("bench", "accuracy", "--tasks", "ppl", ok=False), "pass --data")
    one_line_error(cli("bench", "accuracy", "--tasks", "ppl", "--data", "/no/such/dir", ok=False), "not found")
    one_line_error(cli("bench", "accuracy", "--tasks", "nope", ok=False), "unknown task")


def test_bench_speed_contract_floor_and_plots(tmp_path, capsys):
    from infinigen_kv.cli import main

    model_dir = save_tiny(tmp_path / "model")
    out = tmp_path / "speed"
    assert main(["bench", "speed", "--model", model_dir, "--methods", "full,infinigen,offload,h2o", "--batch", "1,2",
                 "--prompt-len", "48,96", "--new-tokens", "3", "--repeats", "1", "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["machine"]["read_bandwidth_gb_s"] > 0 and result["machine"]["device"] == "cpu"
    rows = result["rows"]
    assert len(rows) == 4 * 2 * 2
    for r in rows:
        assert set(r) >= {"method", "batch", "prompt_len", "new_tokens", "decode_tokens_per_s", "fetched_fraction",
                          "bytes_read_per_step", "prefill_s", "step_s", "floor_s", "step_over_floor"}
        assert r["decode_tokens_per_s"] > 0 and r["step_over_floor"] > 0
        assert r["step_s"] == pytest.approx(r["batch"] / r["decode_tokens_per_s"], rel=1e-2)
    by = {(r["method"], r["batch"], r["prompt_len"]): r for r in rows}
    assert by[("offload", 2, 96)]["fetched_fraction"] == 1.0
    assert by[("infinigen", 2, 96)]["bytes_read_per_step"] < by[("full", 2, 96)]["bytes_read_per_step"]
    for name in ("speed.json", "speed.md", "speed-batch1.png", "speed-batch2.png"):
        assert (out / name).is_file(), name
