"""The prefill attention (model/attention.sdpa: grouped-query heads by SDPA's enable_gqa) gives transformers' sdpa
bits, which copies each K/V head r times."""

import types

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from infinigen_kv.model.attention import sdpa


@pytest.mark.parametrize("repeat", [False, True])
@pytest.mark.parametrize("T,past", [(1, 40), (16, 300), (128, 700), (200, 0)])
def test_grouped_query_sdpa_is_transformers_bits(T, past, repeat, monkeypatch):
    """repeat: the K/V heads repeated for a masked chunk, as on a GPU (its memory-efficient kernel takes no grouped
    heads): the same bits."""
    from infinigen_kv.model import attention

    monkeypatch.setattr(attention, "repeat_groups", lambda query: repeat)
    torch.manual_seed(T + past)
    G, r, d, S = 3, 3, 64, past + T
    module = types.SimpleNamespace(num_key_value_groups=r, is_causal=True)
    q, k, v = torch.randn(2, G * r, T, d), torch.randn(2, G, S, d), torch.randn(2, G, S, d)
    mask = torch.arange(S)[None] <= torch.arange(T)[:, None] + past  # (T, S) causal over the past
    mask = mask[None, None].repeat(2, 1, 1, 1)
    mask[1, ..., :5] = False  # the second row left-padded
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=d**-0.5)  # repeat_kv: each K/V head r times
    got = sdpa(q, k, v, mask, d**-0.5)
    assert got.shape == want.shape == (2, T, G * r, d)
    assert torch.equal(got, want)


def test_a_prompt_without_a_mask_attends_causally():
    q, k, v = torch.randn(1, 4, 10, 16), torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)
    causal = (torch.arange(10)[None] <= torch.arange(10)[:, None])[None, None]
    torch.testing.assert_close(sdpa(q, k, v, None, 0.25), sdpa(q, k, v, causal, 0.25))
