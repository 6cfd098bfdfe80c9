"""INT4/INT8 group-wise KV quantization: error bounds, packing, and generation through the cache."""

import pytest
import torch

import infinigen_kv as ig
from infinigen_kv.methods.quant import GROUP, dequantize, quantize
from conftest import left_padded_batch


@pytest.mark.parametrize("bits", [4, 8])
def test_error_bound_on_random_tensors(bits):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 50, 128) * torch.rand(2, 3, 50, 1) * 10
    q, s, z = quantize(x, bits)
    assert q.dtype == torch.uint8 and q.shape[-1] == 128 * bits // 8 and s.shape[-1] == 128 // GROUP
    y = dequantize(q, s, z, bits, torch.float32)
    g = x.reshape(2, 3, 50, 2, GROUP)
    half_step = ((g.amax(-1) - g.amin(-1)) / (2**bits - 1) / 2).repeat_interleave(GROUP, -1)
    assert ((y - x).abs() <= half_step + 1e-5).all()  # min-max rounding: at most half a step per group
    # the extremes of each group are exact
    yg = y.reshape(2, 3, 50, 2, GROUP)
    torch.testing.assert_close(yg.amin(-1), g.amin(-1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("bits,tol", [(8, 0.05), (4, None)])
def test_generation_through_quant_cache(tiny_models, bits, tol):
    model = tiny_models["llama-gqa"]
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    cache = ig.make_cache("quant", model, bits=bits)
    res = ig.generate(model, ids, mask, cache=cache, max_new_tokens=6, stop_at_eos=False)
    assert res.tokens.shape == (3, 6)
    assert cache.get_seq_length() == 48 + 5
    full_bytes = 3 * 2 * 53 * 16 * 4 * 2  # B x G x n x d x float32, K and V, per layer
    held = sum(b.valid().numel() * b.data.element_size() for b in cache.layers[0].bufs.values())
    # codes + a float32 scale and zero per group of 16 (the tiny model's head size)
    assert held == 3 * 2 * 53 * 2 * (16 * bits // 8 + 8) and held < full_bytes
    if tol is not None:  # INT8: logits close to the full cache's
        with torch.inference_mode():
            ref = model(ids, attention_mask=mask, past_key_values=ig.make_cache("full", model)).logits[:, -1]
            got = model(ids, attention_mask=mask, past_key_values=ig.make_cache("quant", model, bits=8)).logits[:, -1]
        assert (got - ref).abs().max() < tol


def test_bad_bits(tiny_models):
    with pytest.raises(ValueError, match="4 or 8"):
        ig.make_cache("quant", tiny_models["llama-gqa"], bits=3)
