"""Calibration: orthogonal skew (outputs unchanged), partial query weights, fingerprint, save/load, cache."""

import re

import pytest
import torch

import infinigen_kv as ig
from infinigen_kv.model.arch import get_arch
from infinigen_kv.model.weights import from_hf
from infinigen_kv.testing import tiny_hf
from infinigen_kv.methods.infinigen import Calibration, CalibrationError, InfiniGenCache, calibrate
from infinigen_kv.methods.infinigen.calibration import default_path, fingerprint
from infinigen_kv.methods.infinigen.offline import _Recorder, collect_qk, load_or_calibrate
from conftest import KINDS, tiny_model


@pytest.fixture(scope="module")
def svd_calibration(tiny_models):
    return calibrate(tiny_models["llama-gqa"], skew="svd", tokens=512)


def test_skew_is_orthogonal_and_preserves_scores(tiny_models, svd_calibration):
    cal = svd_calibration
    L, G, d, _ = cal.skew.shape
    eye = torch.eye(d).expand(L, G, d, d)
    torch.testing.assert_close(cal.skew.transpose(-1, -2) @ cal.skew, eye, atol=1e-4, rtol=0)
    model = tiny_models["llama-gqa"]
    arch = get_arch(model)
    ids = torch.randint(3, 256, (1, 32))
    qs, ks = collect_qk(model, arch, ids)
    q, k, A = qs[1][: arch.group], ks[1][:1], cal.skew[1, 0]  # query heads of KV head 0
    torch.testing.assert_close((q @ A) @ (k @ A).transpose(-1, -2), q @ k.transpose(-1, -2), atol=1e-4, rtol=1e-4)
    assert cal.channels.shape == (L, G, 8)  # ceil(0.5 x 16)


def test_outputs_unchanged_with_skew(tiny_models, svd_calibration):
    """The skew only steers selection: with everything fetched, logits are the full cache's."""
    model = tiny_models["llama-gqa"]
    ids = torch.randint(3, 256, (2, 40))
    cache = ig.InfiniGenCache(model, ig.InfiniGenConfig(alpha=1e9, budget=1.0), calibration=svd_calibration)
    got = ig.generate(model, ids, cache=cache, max_new_tokens=8, stop_at_eos=False).tokens
    ref = ig.generate(model, ids, cache=ig.make_cache("full", model), max_new_tokens=8, stop_at_eos=False).tokens
    assert torch.equal(got, ref)


def test_opt_partial_query_weights_fold_the_skew(tiny_models):
    model = tiny_models["opt"]
    cal = calibrate(model, tokens=512)
    assert cal.meta["skew"] == "svd" and cal.pq_weight is not None
    arch = get_arch(model)
    x = torch.randn(2, 1, arch.hidden_size)
    l = 2
    q = arch.query(l, x, None, model.backend).view(2, arch.num_kv_heads, arch.group, arch.head_dim)  # pre-scaled as OPT does
    expect = q @ cal.skew_partial[l].unsqueeze(0)
    got = torch.nn.functional.linear(x, cal.pq_weight[l], cal.pq_bias[l]).view_as(expect)
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-4)


def test_save_load_round_trip(tmp_path, svd_calibration):
    path = svd_calibration.save(tmp_path / "cal.safetensors")
    back = Calibration.load(path)
    assert torch.equal(back.skew, svd_calibration.skew) and torch.equal(back.channels, svd_calibration.channels)
    assert back.meta == svd_calibration.meta


def test_an_in_memory_models_fingerprint_covers_every_weight():
    """Two models built in memory that differ only outside the q/k projections (an MLP row, the LM head's rows: a
    test's model whose EOS is never greedy) calibrate differently (their generated text and queries differ): they
    never share a cached calibration."""
    base = tiny_model("llama-gqa")
    for name in ("layers.0.mlp.w2.weight", "lm_head"):
        other = tiny_model("llama-gqa")
        with torch.no_grad():
            w = dict(other.named_parameters())[name]
            w[3] = w.mean(0)
        assert fingerprint(other) != fingerprint(base), name


def test_fingerprint_mismatch_refused(tmp_path, tiny_models, svd_calibration):
    other = tiny_model("llama-gqa", seed=123)  # same shapes, other weights
    assert fingerprint(other) != fingerprint(tiny_models["llama-gqa"])
    with pytest.raises(CalibrationError, match="another model"):
        svd_calibration.check(other)
    path = svd_calibration.save(tmp_path / "cal.safetensors")
    with pytest.raises(CalibrationError, match="another model"):
        ig.InfiniGenCache(other, ig.InfiniGenConfig(calibration=str(path)))


def test_bad_calibration_files(tmp_path):
    with pytest.raises(CalibrationError, match="not found"):
        Calibration.load(tmp_path / "missing.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(CalibrationError, match="cannot read"):
        Calibration.load(junk)


def test_first_use_calibrates_then_loads_from_cache(tiny_models):
    model = tiny_models["qwen2"]
    config = ig.InfiniGenConfig(partial_ratio=0.25)
    first = load_or_calibrate(model, config)
    second = load_or_calibrate(model, config)  # from the cache file: same tensors
    assert torch.equal(first.skew, second.skew) and torch.equal(first.channels, second.channels)
    assert first.meta["fingerprint"] == fingerprint(model) and first.meta["partial_ratio"] == 0.25


@pytest.mark.parametrize("kind", KINDS)
def test_arch_queries_and_keys_are_the_models(kind):
    """Arch.query / Arch.key (what calibration and speculation use) equal the queries and keys transformers' attention
    receives, QK-norm (Qwen3), RoPE scaling (Llama 3.1) and one RoPE per layer type (Gemma 3) included."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    hf, seen = tiny_hf(kind), {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        seen[module.layer_idx] = (query, key)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("capture-test", capture)
    AttentionMaskInterface.register("capture-test", sdpa_mask)  # (without it, transformers drops the windows)
    hf.config._attn_implementation = "capture-test"
    model = from_hf(hf)
    arch = get_arch(model)
    ids = torch.randint(3, 256, (2, 300), generator=torch.Generator().manual_seed(0))  # past the 128 of llama31
    with torch.no_grad():
        hf(ids)
        rec = _Recorder(arch)  # what layer l's input gives (speculation reads layer l+1's RoPE from the same step)
        model(ids, past_key_values=rec, logits_to_keep=1)
    for l in range(arch.num_layers):
        q = rec.qs[l][0].view(-1, 2, 300, arch.head_dim).transpose(0, 1) * arch.q_scale
        k = rec.ks[l][0].view(-1, 2, 300, arch.head_dim).transpose(0, 1)
        torch.testing.assert_close(q, seen[l][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k, seen[l][1], rtol=1e-5, atol=1e-5)
    if arch.rope:  # the kernel's scale (Gemma 3: query_pre_attn_scalar^-0.5, not d^-0.5)
        assert arch.score_scale == pytest.approx(hf.model.layers[0].self_attn.scaling)


def test_recall_is_measured_once_and_kept(tmp_path, tiny_models):
    """layer_budget "recall" needs each layer's recall: `calibrate(recall=True)` measures it; a cached
    calibration without it gets it on first use (saved); a named file without it is refused."""
    model = tiny_models["qwen2"]
    cal = calibrate(model, tokens=512, recall=True)
    assert cal.meta["recall"][0] is None and all(0 < r <= 1 for r in cal.meta["recall"][1:])
    assert len(cal.meta["recall"]) == get_arch(model).num_layers

    config = ig.InfiniGenConfig(partial_ratio=0.5, layer_budget="recall")
    default_path(model, config).unlink(missing_ok=True)  # whatever another test cached
    plain = load_or_calibrate(model, ig.InfiniGenConfig(partial_ratio=0.5))  # cached without recall
    assert "recall" not in plain.meta
    with_recall = load_or_calibrate(model, config, cache_cls=InfiniGenCache)  # measured now, and saved in the cache file
    assert with_recall.meta["recall"][1] is not None
    assert load_or_calibrate(model, ig.InfiniGenConfig(partial_ratio=0.5)).meta["recall"] == with_recall.meta["recall"]

    path = plain.save(tmp_path / "old.safetensors")
    with pytest.raises(CalibrationError, match="no per-layer recall"):
        load_or_calibrate(model, ig.InfiniGenConfig(partial_ratio=0.5, layer_budget="recall", calibration=str(path)))


def test_calibration_reports_progress_and_its_time_without_a_terminal(tiny_models, tmp_path, monkeypatch, capsys):
    """Calibrating on first use says so, shows progress where no bar is drawn (a line at most every
    progress.EVERY seconds: here every step, with what is done and the time left) and how long it took. A model
    built in memory has no tokenizer: it calibrates on text it writes, then on that text's prefill."""
    import importlib

    from infinigen_kv import progress

    calibration = importlib.import_module("infinigen_kv.methods.infinigen.offline")  # calibrating a model

    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(progress, "EVERY", 0.0)
    calibration.load_or_calibrate(tiny_models["llama-gqa"], ig.InfiniGenConfig())
    err = capsys.readouterr().err
    assert "infinigen: calibrating (once for this checkpoint" in err and "infinigen: calibrated in" in err
    for stage in ("writing its text", "prefill"):
        assert re.search(rf"infinigen: calibrating: {stage}: \d+/\d+ tokens \(\d+ s, ~\d+ s left\)", err), err
