"""Task generators (deterministic, answer in the prompt) and the bench commands on a tiny model."""

import json
import sys

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
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert "[1/" in captured.err and " left] " in captured.err  # the run's progress: results done of all, time left
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
    for name in ("accuracy.json", "accuracy.md"):
        assert (out / name).is_file(), name
    assert not list(out.glob("*.png"))  # one fraction and one token budget: no line of two points to draw
    assert "| 32 tok |" in (out / "accuracy.md").read_text()


def test_accuracy_plots_only_lines_of_two_points(tmp_path):
    """A (task, metric) is drawn against the fraction budgets where a method has two of them or more, and against
    the token budgets likewise; a single budget stays a table cell."""
    pytest.importorskip("matplotlib")
    from infinigen_kv.bench.accuracy_report import write_reports

    def row(task, method, budget, value):
        return {"task": task, "method": method, "budget": budget, "metric": "score", "value": value, "n": 1,
                "fetched_fraction": 1.0}

    rows = [row("passkey-160", "full", None, 1.0), row("passkey-160", "infinigen", 0.1, 1.0),
            row("passkey-160", "infinigen", 0.2, 1.0), row("passkey-160", "infinigen", 64, 1.0),
            row("vt-160", "full", None, 1.0), row("vt-160", "h2o", 0.1, 0.5)]
    written = write_reports({"rows": rows}, tmp_path)
    assert sorted(p.name for p in written if p.suffix == ".png") == ["passkey-160-score.png"]


def main_error(capsys, *args, text: str):
    """`infinigen ARGS` in this process (a CLI process costs ~7 s of imports; test_cli runs the real ones) fails
    with one line on stderr that says `text`."""
    from infinigen_kv.cli import main

    capsys.readouterr()
    assert main(list(args)) != 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and text in lines[0], lines


def test_bench_accuracy_needs_data(capsys):
    one_line_error(cli("bench", "accuracy", "--tasks", "ppl", ok=False), "pass --data")  # the real process, once
    main_error(capsys, "bench", "accuracy", "--tasks", "ppl", "--data", "/no/such/dir", text="not found")
    main_error(capsys, "bench", "accuracy", "--tasks", "nope", text="unknown task")


def test_bench_speed_contract_floor_and_plots(tmp_path, capsys, monkeypatch):
    """The rows, the plots, and each prefill's progress on stderr (here every chunk of 32 tokens: a long prompt's
    lines come every ~10 s)."""
    from infinigen_kv.cli import main
    from infinigen_kv.runtime import generation

    monkeypatch.setattr(generation, "PREFILL_CHUNK", 32)
    monkeypatch.setattr(generation.PrefillProgress, "EVERY_S", 0.0)
    model_dir = save_tiny(tmp_path / "model")
    out = tmp_path / "speed"
    assert main(["bench", "speed", "--model", model_dir, "--methods", "full,infinigen,offload,h2o", "--batch", "1,2",
                 "--prompt-len", "48,96", "--new-tokens", "3", "--repeats", "1", "--min-budget", "0", "--out", str(out),
                 "--json"]) == 0  # no floor: the tiny prompts are all under it
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert "infinigen: bench speed infinigen B2 x 96: prefill 32/96 tokens (" in captured.err
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


def test_bench_busy_runs_fresh_processes_beside_the_competitor(tmp_path, capsys, monkeypatch):
    """`bench busy`: each cell a fresh `bench speed` process started while the competitor spins, the competitor's
    processes gone after it; speeds against the same setting alone; the table and files."""
    from infinigen_kv.bench import busy
    from infinigen_kv.cli import main

    started = []
    popen = busy.subprocess.Popen
    monkeypatch.setattr(busy.subprocess, "Popen", lambda *a, **k: started.append(popen(*a, **k)) or started[-1])
    cmd = [sys.executable, "-c", "import json, os; print(json.dumps({'pid': os.getpid()}))"]
    assert busy.beside("busy-loops", cmd, {})["pid"] > 0
    assert len(started) == len(busy.COMPETITORS["busy-loops"]) + 1  # the competitors, then the measured command
    assert all(p.poll() is not None for p in started)

    model_dir = save_tiny(tmp_path / "model")
    assert main(["bench", "busy", "--model", model_dir, "--methods", "full,infinigen", "--shapes", "1x32",
                 "--competitors", "none", "--settings", "default", "--new-tokens", "2", "--repeats", "1",
                 "--out", str(tmp_path / "busy"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["method"], r["batch"], r["prompt_len"], r["competitor"]) for r in rows] == [
        ("full", 1, 32, "none"), ("infinigen", 1, 32, "none")]
    assert all(r["decode_tokens_per_s"] > 0 and r["decode_vs_alone"] == 1.0 and r["prefill_tokens_per_s"] > 0
               for r in rows)
    assert (tmp_path / "busy" / "busy.md").read_text().count("| B1 x 32 |") == 2
    ratios = busy.with_ratios([{**rows[0]}, {**rows[0], "competitor": "busy-loops",
                                             "decode_tokens_per_s": rows[0]["decode_tokens_per_s"] / 4}])
    assert ratios[1]["decode_vs_alone"] == 0.25


@pytest.mark.parametrize("args,text", [(["--shapes", "4y4096"], "a shape is batch x prompt tokens"),
                                       (["--competitors", "none,idle"], "idle is not one of"),
                                       (["--generate", "/no/such/prompt.txt"], "no such file")])
def test_bench_busy_bad_input(args, text, capsys):
    from infinigen_kv.cli import main

    with pytest.raises(SystemExit) as exit:  # argparse's exit, in process (the subprocess path: test_cli.py)
        main(["bench", "busy", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(err) == 1 and err[0].startswith("infinigen: error: ") and text in err[0]


ESSAY = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
         "foolishness, it was the epoch of belief, it was the epoch of incredulity. ") * 40


@pytest.mark.parametrize("task", __import__("infinigen_kv.bench.ruler", fromlist=["TASKS"]).TASKS)
def test_ruler_generators_sized_deterministic_answers_in_prompt(tok, task):
    """Each RULER task fits its token length (within 10%), is the same for a seed and
    other for another, and every expected string is in the prompt."""
    from infinigen_kv.bench import ruler

    with pytest.raises(ValueError, match="cannot hold"):
        ruler.generate(task, tok, 40, seed=3, essay=ESSAY)
    for length in (1000, 2000):
        s = ruler.generate(task, tok, length, seed=3, essay=ESSAY)
        n = len(tok(s.prompt, add_special_tokens=False)["input_ids"])
        assert 0.9 * length <= n <= length, (task, length, n)
        assert s.answers and all(a in s.prompt for a in s.answers)
        assert ruler.generate(task, tok, length, seed=3, essay=ESSAY) == s
        assert ruler.generate(task, tok, length, seed=4, essay=ESSAY).prompt != s.prompt


def test_ruler_task_shapes_and_scoring(tok):
    import re
    from collections import Counter

    from infinigen_kv.bench import ruler

    def needles(s):
        return re.findall(r"One of the special magic (\w+) for (\S+) is: (\S+)\.", s.prompt)

    s = ruler.generate("niah_multikey_1", tok, 1000, 0, ESSAY)
    assert len(needles(s)) == 4 and len(s.answers) == 1  # three distractor keys
    for task in ("niah_multikey_2", "niah_multikey_3"):  # the haystack is nothing but needles
        found = needles(ruler.generate(task, tok, 1000, 0))
        assert len(found) > 3 and len({k for _, k, _ in found}) == len(found)
    assert re.fullmatch(r"[0-9a-f-]{36}", needles(ruler.generate("niah_multikey_3", tok, 1000, 0))[0][1])
    s = ruler.generate("niah_multivalue", tok, 1000, 0, ESSAY)
    assert len(s.answers) == 4 and len({k for _, k, _ in needles(s)}) == 1
    s = ruler.generate("niah_multiquery", tok, 1000, 0, ESSAY)
    assert len(s.answers) == 4 and s.prompt.rstrip().endswith("mentioned in the provided text are")
    s = ruler.generate("ruler_vt", tok, 1000, 0)
    assert len(s.answers) == 5 and s.prompt.index(f"VAR {s.answers[1]} = VAR {s.answers[0]}") > 0
    s = ruler.generate("ruler_cwe", tok, 1500, 0)
    counts = Counter(re.findall(r"\d+\. (\w+)", s.prompt))
    assert set(s.answers) == {w for w, _ in counts.most_common(10)}
    assert min(counts[w] for w in s.answers) > max(c for w, c in counts.items() if w not in s.answers)
    s = ruler.generate("ruler_fwe", tok, 1500, 0)
    counts = Counter(w.strip() for w in s.prompt.split("coded words. ")[1].split("\n")[0].split(" .... "))
    assert [w for w, _ in counts.most_common(3)] == s.answers
    with pytest.raises(ValueError, match="--data"):
        ruler.generate("niah_single_2", tok, 1000, 0)  # an essay haystack needs prose
    assert ruler.score("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert ruler.score("ABC", ["abc"]) == 1.0


def test_bench_accuracy_ruler_suite_and_mean(tmp_path, capsys):
    from infinigen_kv.cli import main

    model_dir = save_tiny(tmp_path / "model")
    text = tmp_path / "essay.txt"
    text.write_text(ESSAY)
    assert main(["bench", "accuracy", "--model", model_dir, "--methods", "full,infinigen", "--tasks", "ruler",
                 "--budget", "0.5,64", "--lengths", "880", "--samples", "1", "--data", str(text), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    from infinigen_kv.bench.ruler import TASKS

    assert {r["task"] for r in rows} == {f"{t}-880" for t in TASKS} | {"ruler-mean-880"}
    means = {(r["method"], r["budget"]): r["value"] for r in rows if r["task"] == "ruler-mean-880"}
    assert set(means) == {("full", None), ("infinigen", 0.5), ("infinigen", 64)}
    for key, mean in means.items():
        got = [r["value"] for r in rows if (r["method"], r["budget"]) == key and r["task"] != "ruler-mean-880"]
        assert mean == pytest.approx(sum(got) / len(got), abs=1e-4)
    main_error(capsys, "bench", "accuracy", "--tasks", "niah_single_2", text="need text")
    from infinigen_kv.bench.accuracy import DataError, load_essay

    with pytest.raises(DataError, match="essay haystacks .* need text"):  # library callers: no --data check
        load_essay(None)


def test_ruler_summary_table():
    from infinigen_kv.bench.accuracy_report import ruler_summary

    rows = [{"task": t, "method": m, "budget": b, "value": v, "n": 10, "fetched_fraction": f}
            for m, b, f, vs in (("full", None, 1.0, (1.0, 0.5)), ("infinigen", 0.1, 0.12, (1.0, 0.0)))
            for t, v in zip(("niah_single_1-4000", "niah_multikey_2-4000", "ruler-mean-4000"), (*vs, sum(vs) / 2))]
    lines = ruler_summary({"rows": rows}).splitlines()
    assert "| method | budget | s1 | mk2 | **mean** | fetched | n |" in lines
    assert "| infinigen | 0.1 | 1.00 | 0.00 | **0.500** | 0.120 | 10 |" in lines
    assert "| full | - | 1.00 | 0.50 | **0.750** | 1.000 | 10 |" in lines
    assert ruler_summary({"rows": rows[:2]}) == ""


def test_bench_accuracy_resumes_from_its_samples(tmp_path, capsys, monkeypatch):
    """Per-sample results go to OUT/samples.jsonl; --resume runs only what is missing and gives the same table
    as one run; other settings are a one-line error, not a mixed table."""
    from infinigen_kv.bench import accuracy
    from infinigen_kv.cli import main

    model_dir = save_tiny(tmp_path / "model")
    args = ["bench", "accuracy", "--model", model_dir, "--methods", "full,infinigen,h2o", "--tasks", "passkey,niah",
            "--budget", "0.2,32", "--lengths", "200", "--json"]
    assert main([*args, "--samples", "2", "--out", str(tmp_path / "one")]) == 0
    one = json.loads(capsys.readouterr().out)["rows"]
    lines = (tmp_path / "one" / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 1 + 2 * 2 * 5  # header; 2 tasks x 2 samples x (full, infinigen x 2, h2o x 2)

    prefills = []
    real = accuracy.prefill
    monkeypatch.setattr(accuracy, "prefill", lambda *a, **k: prefills.append(1) or real(*a, **k))
    out = str(tmp_path / "two")
    assert main([*args, "--samples", "1", "--out", out]) == 0
    assert len(prefills) == 2  # one prefill per prompt for the three methods and all budgets (TeeCache, fork)
    capsys.readouterr()
    prefills.clear()
    samples = tmp_path / "two" / "samples.jsonl"  # a run made before a knob existed: its header lacks it
    header, *rest = samples.read_text().splitlines()
    old = json.loads(header)
    del old["options"]["layer_budget"]
    samples.write_text("\n".join([json.dumps(old), *rest]) + "\n")
    assert main([*args, "--samples", "2", "--out", out, "--resume"]) == 0
    assert len(prefills) == 2  # only the second sample's
    assert json.loads(capsys.readouterr().out)["rows"] == one
    main_error(capsys, *[a for a in args if a != "--json"], "--samples", "2", "--out", out, "--resume", "--alpha", "3",
               text="holds results of other settings")
    main_error(capsys, "bench", "accuracy", "--tasks", "passkey", "--resume", text="--resume needs --out")


def test_bench_accuracy_batched_decode_gives_the_same_outputs(tmp_path, capsys):
    """--batch 3 writes the same output for every sample, method and budget as --batch 1 (the niah prompts
    differ in length: 510, 510 and 507 tokens of the tiny tokenizer, so rows join left-padded)."""
    from infinigen_kv.cli import main

    model_dir = save_tiny(tmp_path / "model")
    got = {}
    for batch in (1, 3):
        out = tmp_path / f"b{batch}"
        assert main(["bench", "accuracy", "--model", model_dir, "--methods",
                     "full,infinigen,h2o,streaming,quant", "--tasks", "niah,passkey", "--budget", "0.2,24", "--lengths", "300", "--samples", "3",
                     "--batch", str(batch), "--out", str(out)]) == 0
        lines = [json.loads(l) for l in (out / "samples.jsonl").read_text().splitlines()[1:]]
        got[batch] = {(r["task"], r["seed"], r["method"], r["budget"]): r["output"] for r in lines}
    capsys.readouterr()
    assert len(got[1]) == 2 * 3 * 8 and got[1] == got[3]
