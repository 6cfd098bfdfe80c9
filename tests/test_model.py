"""Our model classes against transformers' (the reference): the same logits at prefill and at every decode step, for
every supported architecture, from weights copied in memory and from a checkpoint on disk."""

import pytest
import torch

import infinigen_kv as ig
from infinigen_kv.model.hparams import UnsupportedModelError, from_config
from infinigen_kv.model.transformer import Transformer
from infinigen_kv.model.weights import from_hf
from infinigen_kv.testing import KINDS, left_padded_batch, tiny_hf

# float32 throughout: transformers' ops and ours differ in order (merged q/k/v, the kernels), not in precision
TOL = dict(atol=2e-5, rtol=1e-4)


def hf_steps(hf, ids, mask, steps):
    """transformers' greedy logits: the prompt's last, then each of `steps` decode steps' (B, steps + 1, V)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = hf(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache).logits[:, -1]
    logits, pos = [out], positions[:, -1:] + 1
    for _ in range(steps):
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        out = hf(input_ids=out.argmax(-1)[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache).logits[:, -1]
        logits.append(out)
        pos = pos + 1
    return torch.stack(logits, 1)


def our_steps(model, ids, mask, steps, method="full"):
    from infinigen_kv.runtime.generation import prefill

    cache = ig.make_cache(method, model, kv_dtype="float32")  # (the CPU default rounds K/V to bfloat16)
    logits = prefill(model, ids, mask, cache, steps)
    got, pos = [logits], (mask.cumsum(-1) - 1).clamp(min=0)[:, -1:] + 1
    for _ in range(steps):
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        logits = model.decode(cache, logits.argmax(-1), pos, mask)
        got.append(logits)
        pos = pos + 1
    return torch.stack(got, 1)


@pytest.mark.parametrize("kind", KINDS)
@torch.inference_mode()
def test_logits_equal_transformers_at_prefill_and_each_step(kind):
    hf = tiny_hf(kind)
    ours = from_hf(hf)
    ids, mask = left_padded_batch(lengths=(24, 17))
    torch.testing.assert_close(our_steps(ours, ids, mask, 4), hf_steps(hf, ids, mask, 4), **TOL)


@torch.inference_mode()
def test_a_model_moved_to_bfloat16_computes_in_it():
    """`.to(torch.bfloat16)` (as a GPU user does): biases, activations and weights all in bfloat16 (a float32 bias
    beside bfloat16 products failed), the rotary frequencies still float32; tokens as transformers' bfloat16 model."""
    hf = tiny_hf("qwen2").to(torch.bfloat16)
    ours = from_hf(tiny_hf("qwen2")).to(torch.bfloat16)
    assert ours.dtype == torch.bfloat16 and all(p.dtype == torch.bfloat16 for p in ours.parameters())
    assert all(b.dtype == torch.float32 for b in ours.buffers())
    ids, mask = left_padded_batch(lengths=(24, 17))
    got, ref = our_steps(ours, ids, mask, 4), hf_steps(hf, ids, mask, 4)
    assert got.dtype == torch.bfloat16
    assert (got.float().argmax(-1) == ref.float().argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
@torch.inference_mode()
def test_held_weights_compute_their_rounded_values(weights, float32_products):
    """bfloat16 / int8-row weights: our model equals a float32 model of the rounded weights' values (prompt chunks
    multiplied in float32; int8 rows' decode steps within their int8 activations' rounding, 2^-8 of a group's
    largest value)."""
    from infinigen_kv.model import ops

    hf = tiny_hf("llama-gqa")
    held = from_hf(hf, weights)
    exact = from_hf(hf)
    with torch.no_grad():
        for (name, p), (_, q) in zip(held.named_parameters(), exact.named_parameters()):
            if p.dtype != torch.float32:
                q.copy_(ops.dense(p, torch.float32))
    float32_products(held, exact)
    ids, mask = left_padded_batch(lengths=(20, 9))
    tol = dict(atol=1e-2, rtol=1e-2) if weights == "int8" else TOL
    torch.testing.assert_close(our_steps(held, ids, mask, 3), our_steps(exact, ids, mask, 3), **tol)


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
@torch.inference_mode()
def test_bfloat16_products_round_a_prompt_chunk_only(weights, monkeypatch):
    """Where the CPU multiplies bfloat16 natively, a prompt chunk's products over held weights run in bfloat16: the
    logits stay within bfloat16's rounding of the float32 products', each row the same bits alone or in a batch; a
    decode step's rows still take the float32 kernels."""
    import dataclasses

    from infinigen_kv.model import ops

    model = from_hf(tiny_hf("llama-gqa"), weights)
    calls = []
    monkeypatch.setattr(ops, "bf16_linear", lambda *a, f=ops.bf16_linear: calls.append(1) or f(*a))
    ids = torch.randint(3, 256, (2, 40))
    model.backend = dataclasses.replace(model.backend, bf16_products=False, int_prefill=False)  # (int8: the GEMM)
    exact = model(ids, use_cache=False).logits
    assert not calls
    model.backend = dataclasses.replace(model.backend, bf16_products=True)  # (emulated where the CPU has no BF16)
    products = model(ids, use_cache=False).logits
    assert calls
    alone = model(ids[1:], use_cache=False).logits
    torch.testing.assert_close(alone, products[1:], rtol=0, atol=0)
    err = (products - exact).norm() / exact.norm()
    assert 0 < err < 1e-2, err
    calls.clear()
    model(ids[:, :1], use_cache=False)  # a decode step's rows: the float32 kernels (no bfloat16 product)
    assert not calls


@torch.inference_mode()
def test_a_checkpoint_on_disk_loads_into_our_classes(tmp_path):
    """save_pretrained's safetensors, read tensor by tensor into merged weights: the same logits as transformers."""
    from conftest import save_tiny

    d = save_tiny(tmp_path / "m", kind="qwen2")
    model, tok = ig.load_model(str(d), dtype="float32")
    assert isinstance(model, Transformer) and model.layers[0].attn.wqkv.bias is not None
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    ids, mask = left_padded_batch(lengths=(12,))
    torch.testing.assert_close(our_steps(model, ids, mask, 2), hf_steps(hf, ids, mask, 2), **TOL)


def test_configs_read_both_rope_layouts_and_refuse_the_unknown():
    base = dict(model_type="llama", vocab_size=8, hidden_size=8, num_attention_heads=2, num_hidden_layers=1,
                intermediate_size=8)
    old = from_config({**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    new = from_config({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}})
    assert old.ropes == new.ropes and old.ropes[0][1].kind == "llama3"
    with pytest.raises(UnsupportedModelError, match="yarn"):
        from_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(UnsupportedModelError, match="unsupported architecture 'bert'"):
        from_config({**base, "model_type": "bert"})
