"""The prefill attention's grouped-query path (model/attention._sdpa) gives transformers' sdpa bits."""

import types

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from infinigen_kv.model.attention import _sdpa


@pytest.mark.parametrize("T,past", [(1, 40), (16, 300), (128, 700), (200, 0)])
@pytest.mark.parametrize("float_mask", [False, True])
def test_grouped_query_sdpa_is_transformers_bits(T, past, float_mask):
    torch.manual_seed(T + past)
    G, r, d, S = 3, 3, 64, past + T
    module = types.SimpleNamespace(num_key_value_groups=r, is_causal=True)
    q, k, v = torch.randn(2, G * r, T, d), torch.randn(2, G, S, d), torch.randn(2, G, S, d)
    mask = torch.arange(S)[None] <= torch.arange(T)[:, None] + past  # (T, S) causal over the past
    mask = mask[None, None].repeat(2, 1, 1, 1)
    mask[1, ..., :5] = False  # the second row left-padded
    if float_mask:
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=d**-0.5)  # repeat_kv: each K/V head r times
    got, _ = _sdpa(module, q, k, v, mask, d**-0.5, {})
    assert got.shape == want.shape == (2, T, G * r, d)
    assert torch.equal(got, want)


def test_grouped_query_sdpa_does_not_repeat_the_kv_heads(monkeypatch):
    """A chunk over a past on CPU never copies each K/V head r times (transformers' repeat_kv)."""
    import transformers.integrations.sdpa_attention as sdpa

    def refuse(*_):
        raise AssertionError("repeat_kv called")

    monkeypatch.setattr(sdpa, "repeat_kv", refuse)
    module = types.SimpleNamespace(num_key_value_groups=3, is_causal=True)
    q, k, v = torch.randn(1, 9, 8, 64), torch.randn(1, 3, 40, 64), torch.randn(1, 3, 40, 64)
    mask = (torch.arange(40)[None] <= torch.arange(8)[:, None] + 32)[None, None]
    assert _sdpa(module, q, k, v, mask, 0.125, {})[0].shape == (1, 8, 9, 64)
    with pytest.raises(AssertionError, match="repeat_kv"):  # what transformers' own path does
        sdpa.sdpa_attention_forward(module, q, k, v, mask, scaling=0.125)
