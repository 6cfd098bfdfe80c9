"""quest (methods/quest.py): exact at budget 1.0 on every architecture and a left-padded batch; at a binding budget
each (sequence, KV head) attends the pages of the highest upper bounds (each page's bound >= every q . k in it),
whole pages within the budget, never padding; the same choices through the CPU kernel and the PyTorch path."""

import pytest
import torch

import infinigen_kv as ig
from conftest import KINDS, left_padded_batch
from infinigen_kv.methods.quest import QuestSelect, page_bounds, upper_bounds
from infinigen_kv.model import backend
from test_exactness import step_logits


@pytest.mark.parametrize("kind", KINDS)
def test_quest_is_exact_at_full_budget(tiny_models, kind):
    model = tiny_models[kind]
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    ref = step_logits(model, ig.make_cache("full", model), ids, mask)
    cache = ig.make_cache("quest", model, budget=1.0)
    torch.testing.assert_close(step_logits(model, cache, ids, mask), ref, atol=1e-4, rtol=1e-4)
    assert cache.stats["fetched_fraction"] == pytest.approx(1.0)


def test_page_bounds_bound_every_key():
    torch.manual_seed(0)
    keys, q = torch.randn(2, 3, 64, 16), torch.randn(2, 3, 4, 16)
    lo, hi = page_bounds(keys, 16)
    ub = upper_bounds(q, lo, hi)  # (B, G, r, P)
    exact = (q @ keys.transpose(-1, -2)).view(2, 3, 4, 4, 16).amax(-1)  # each page's largest q . k
    assert (ub >= exact - 1e-5).all() and ub.shape == (2, 3, 4, 4)


@pytest.mark.parametrize("kernels", [True, False])
def test_quest_attends_the_pages_of_the_highest_bounds(tiny_models, kernels, monkeypatch):
    """Budget 0.3 of a left-padded batch's past, no floor: each fetch holds whole pages of the top bounds (recomputed
    here from the pool's keys and the layer's query), at most the cap, no padding; the kernels and the reference
    choose alike."""
    model = tiny_models["llama-gqa"]
    monkeypatch.setattr(model, "backend", backend.build("cpu", kernels=kernels))
    ids, mask = left_padded_batch(lengths=(90, 70))
    cache = ig.make_cache("quest", model, budget=0.3, min_budget=0, page_size=8)
    seen = []
    real = QuestSelect.choose_at_query

    def spy(self, c, layer, q, step):
        fetch = real(self, c, layer, q, step)
        if fetch is not None:
            seen.append((layer, q.clone(), fetch, c.layers[layer].k.valid().float().clone()))
        return fetch

    monkeypatch.setattr(QuestSelect, "choose_at_query", spy)
    step_logits(model, cache, ids, mask, steps=3)
    assert seen and {layer for layer, *_ in seen} == set(range(2, len(model.layers)))  # the first two dense
    pad = (mask == 0).sum(-1)  # (B,)
    for layer, q, fetch, keys in seen:
        B, G, n = keys.shape[0], keys.shape[1], keys.shape[2]
        cap = -(-3 * n // 10)
        assert fetch.idx.shape[-1] <= cap
        full = n // 8 * 8
        lo, hi = page_bounds(keys[:, :, :full], 8)
        if full < n:  # the partial last page
            lo = torch.cat([lo, keys[:, :, full:].amin(2, keepdim=True)], 2)
            hi = torch.cat([hi, keys[:, :, full:].amax(2, keepdim=True)], 2)
        P = lo.shape[2]
        ub = upper_bounds(q.view(B, G, -1, q.shape[-1]), lo, hi)  # (B, G, r, P)
        for b in range(B):
            valid_pages = torch.arange(P) * 8 + 7 >= pad[b]
            for g in range(G):
                got = fetch.idx[b, g, : fetch.count[b, g]]
                assert (got >= pad[b]).all() and (got < n).all()  # never padding
                pages = sorted(set((got // 8).tolist()))
                s = ub[b, g].masked_fill(~valid_pages, float("-inf"))
                rel = (s - s.amax(-1, keepdim=True)).amax(0)
                others = [p for p in range(P) if p not in pages and valid_pages[p]]
                if others:
                    assert min(rel[pages]) >= max(rel[others]) - 1e-4  # the chosen are the top bounds


def test_quest_generates_under_its_budget(tiny_models):
    model = tiny_models["qwen2"]
    ids = torch.randint(3, 256, (2, 200), generator=torch.Generator().manual_seed(1))
    cache = ig.make_cache("quest", model, budget=0.25, min_budget=0)
    out = ig.generate(model, ids, cache=cache, max_new_tokens=8, stop_at_eos=False)
    assert out.tokens.shape == (2, 8)
    assert 0.25 < cache.stats["fetched_fraction"] < 0.8  # two dense layers of four, the rest ~0.25
