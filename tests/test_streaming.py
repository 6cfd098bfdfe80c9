"""StreamingLLM: sinks + recent window within the budget, evicted for good, exact when the budget covers all."""

import math

import pytest
import torch

import infinigen_kv as ig
from conftest import left_padded_batch
from test_exactness import step_logits


def kept_positions(layer, b, g=0):
    return sorted(layer.pos.valid()[b, g, : int(layer.kept[b]), 0].tolist())


def test_keeps_sinks_and_recent_exactly_budget(tiny_models):
    model = tiny_models["llama-gqa"]
    ids, mask = left_padded_batch(lengths=(60, 45))
    cache = ig.make_cache("streaming", model, budget=0.25, min_budget=0)
    r = ig.generate(model, ids, mask, cache=cache, max_new_tokens=9, stop_at_eos=False)
    layer = cache.layers[2]
    seen = 60 + 8  # the last sampled token is not fed back
    for b, (n, first) in enumerate([(60, 0), (45, 15)]):
        n_valid = n + 8
        cap = math.ceil(0.25 * n_valid)
        kept = kept_positions(layer, b)
        assert len(kept) == cap  # exactly budget x n entries
        sinks = list(range(first, first + 4))
        recent = list(range(seen - (cap - 4), seen))
        assert kept == sinks + recent
    assert r.tokens.shape == (2, 9)
    assert cache.stats["fetched_fraction"] == pytest.approx((17 + 14) / (68 + 53), abs=0.01)
    # the bytes model counts the kept slots attention reads (the longer row's, shared by the batch), not the past
    L, G, d = len(cache.layers), layer.k.heads, layer.k.width
    slots = sum(math.ceil(0.25 * (60 + t)) for t in range(1, 9))  # kept at each decode step, 60-token row
    kv = layer.k.data.element_size()  # the rows' storage (bf16 by default on CPU)
    assert cache.stats["kv_bytes_per_step"] == L * 2 * G * 2 * d * kv * slots // 8


def test_small_budget_changes_outputs_but_runs(tiny_models):
    model = tiny_models["qwen2"]
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    ref = step_logits(model, ig.make_cache("full", model), ids, mask)
    got = step_logits(model, ig.make_cache("streaming", model, budget=0.2, min_budget=0), ids, mask)
    assert torch.isfinite(got).all() and not torch.allclose(got, ref, atol=1e-3)


def test_multi_token_forward_after_decode_is_refused(tiny_models):
    model = tiny_models["llama-gqa"]
    ids, mask = left_padded_batch(lengths=(30,))
    cache = ig.make_cache("streaming", model, budget=0.5, min_budget=0)
    ig.generate(model, ids, mask, cache=cache, max_new_tokens=3, stop_at_eos=False)
    with pytest.raises(NotImplementedError, match="new cache per prompt"):
        with torch.inference_mode():
            model(torch.randint(3, 200, (1, 4)), past_key_values=cache)


@pytest.mark.parametrize("method", ["streaming", "h2o"])
def test_budget_as_a_token_count(tiny_models, method):
    """Budget=12 keeps 12 entries per sequence whatever its length (fewer while it has fewer
    tokens); a token count beyond the context is the full cache."""
    model = tiny_models["llama-gqa"]
    ids, mask = left_padded_batch(lengths=(60, 5))
    cache = ig.make_cache(method, model, budget=12)
    ig.generate(model, ids, mask, cache=cache, max_new_tokens=6, stop_at_eos=False)
    for layer in cache.layers:
        assert layer.kept.tolist() == [12, 5 + 5]  # the short row has 10 tokens so far: it keeps them all
    with torch.inference_mode():
        full = step_logits(model, ig.make_cache("full", model), ids, mask)
        big = step_logits(model, ig.make_cache(method, model, budget=10**6), ids, mask)
    torch.testing.assert_close(big, full)
