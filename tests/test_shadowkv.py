"""shadowkv (methods/shadowkv.py): exact at budget 1.0 on every architecture and a left-padded batch; the low-rank
factors of a layer's keys before RoPE rebuild them exactly at full rank and closely below it; at a binding budget each
(sequence, KV head) attends its local and decoded rows, its outlier chunks and the chunks of the highest landmark
votes, within the cap, never padding, the chosen chunks' keys rebuilt and rotated at their positions; served."""

import pytest
import torch

import infinigen_kv as ig
from conftest import KINDS, left_padded_batch
from infinigen_kv.methods.shadowkv import ShadowKVSelect, low_rank, rope_at, rotate, row_positions
from infinigen_kv.model import backend
from infinigen_kv.model.kv import from_rows
from test_exactness import step_logits


@pytest.mark.parametrize("kind", KINDS)
def test_shadowkv_is_exact_at_full_budget(tiny_models, kind):
    model = tiny_models[kind]
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    ref = step_logits(model, ig.make_cache("full", model), ids, mask)
    cache = ig.make_cache("shadowkv", model, budget=1.0, rank=4)
    torch.testing.assert_close(step_logits(model, cache, ids, mask), ref, atol=1e-4, rtol=1e-4)
    assert cache.stats["fetched_fraction"] == pytest.approx(1.0)


def test_low_rank_rebuilds_the_keys():
    torch.manual_seed(0)
    basis = torch.randn(2, 6, 32)  # keys of rank 6 in 32 channels, and a little noise
    flat = torch.randn(2, 100, 6) @ basis
    coef, v = low_rank(flat, 32)
    torch.testing.assert_close(coef @ v, flat, atol=1e-3, rtol=1e-3)
    coef, v = low_rank(flat + 1e-3 * torch.randn_like(flat), 6)
    assert coef.shape == (2, 100, 6) and v.shape == (2, 6, 32)
    assert ((coef @ v - flat).norm() / flat.norm()) < 1e-2


def test_rotation_is_undone_and_positions_follow_the_padding():
    freqs = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    x, pos = torch.randn(3, 5, 8), torch.arange(15).view(3, 5)
    cos, sin = rope_at(freqs, pos)
    torch.testing.assert_close(rotate(rotate(x, cos, sin), cos, -sin), x, atol=1e-5, rtol=1e-5)
    keep = torch.tensor([[False, False, True, True], [True, True, True, True]])
    assert row_positions(keep, torch.tensor([2, 4]), 4).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    assert row_positions(None, torch.tensor([6]), 4).tolist() == [[2, 3, 4, 5]]


@pytest.mark.parametrize("kernels", [True, False])
def test_shadowkv_attends_its_chunks_with_rebuilt_keys(tiny_models, kernels, monkeypatch):
    """Budget 0.3 of a left-padded batch's past, no floor, rank 4 of the keys' 2 x 16 channels: each fetch holds the
    local rows, the outliers, and the chunks of the top votes (recomputed here from the landmarks and the layer's
    query), at most the cap, no padding; the rebuilt keys are the factors' rows rotated at their positions, near the
    exact keys; kernels and reference alike."""
    model = tiny_models["llama-gqa"]
    monkeypatch.setattr(model, "backend", backend.build("cpu", kernels=kernels))
    ids, mask = left_padded_batch(lengths=(90, 70))
    cache = ig.make_cache("shadowkv", model, budget=0.3, min_budget=0, rank=4, chunk=4, local=8)
    seen = []
    real = ShadowKVSelect.choose_at_query

    def spy(self, c, layer, q, step):
        fetch = real(self, c, layer, q, step)
        if fetch is not None:
            seen.append((layer, q.clone(), fetch, c.layers[layer].k.valid().float().clone(), self.shadows[layer]))
        return fetch

    monkeypatch.setattr(ShadowKVSelect, "choose_at_query", spy)
    step_logits(model, cache, ids, mask, steps=3)
    assert seen and {layer for layer, *_ in seen} == set(range(len(model.layers)))
    pad = (mask == 0).sum(-1)  # (B,)
    scale = cache.arch.score_scale
    for layer, q, fetch, keys, shadow in seen:
        B, G, n, d = keys.shape
        cap = -(-3 * n // 10)
        real = fetch.real
        assert real.sum(-1).max() <= cap and fetch.keys is not None
        C = shadow.C
        assert C == (shadow.n0 - 8) // 4
        k = fetch.keys.shape[2]
        chosen = fetch.idx[..., :k]
        tail = torch.arange(C * 4, n)
        for b in range(B):
            for g in range(G):
                got = fetch.idx[b, g][real[b, g]]
                assert (got >= pad[b]).all() and (got < n).all()  # never padding
                assert set(tail[tail >= pad[b]].tolist()) <= set(got.tolist())  # the local and decoded rows
                # the votes: softmax over the selectable chunks' landmarks, the group's heads by their maximum
                s = (q.view(B, G, -1, d)[b, g].float() @ shadow.landmarks[b, g].T) * scale
                s = s.masked_fill(~shadow.selectable[b, g], float("-inf"))
                votes = torch.softmax(s, -1).amax(0)
                picked = sorted(set((chosen[b, g][real[b, g, :k]] // 4).tolist()))
                others = [c for c in range(C) if c not in picked and shadow.selectable[b, g, c]]
                if picked and others:
                    assert min(votes[picked]) >= max(votes[others]) - 1e-5
        # rebuilt keys: near the exact ones where the rows are real (rank 4 of 32 channels on random weights is
        # far from exact; the check is the rotation: the same rows' exact keys are closer than a shuffle's)
        exact = keys.gather(2, chosen.unsqueeze(-1).expand(-1, -1, -1, d))
        ok = real[..., :k]
        err = (fetch.keys.float() - exact)[ok].norm()
        shuffled = (fetch.keys.float() - exact.roll(1, 2))[ok].norm()
        assert err < shuffled


def test_shadowkv_rebuilt_keys_at_full_rank_are_the_keys(tiny_models):
    """At the keys' own width the low-rank factors hold them whole: rebuilt keys equal the pool's (RoPE undone
    and redone in float32)."""
    model = tiny_models["llama-gqa"]
    G, d = model.args.n_kv_heads, model.args.head_dim
    ids = torch.randint(3, 256, (1, 120), generator=torch.Generator().manual_seed(2))
    cache = ig.make_cache("shadowkv", model, budget=0.3, min_budget=0, rank=G * d - 1)
    out = ig.generate(model, ids, cache=cache, max_new_tokens=2, stop_at_eos=False)
    assert out.tokens.shape == (1, 2)
    sel = cache.selection
    shadow = sel.shadows[1]
    rows = torch.arange(shadow.C * sel.chunk).view(1, 1, -1).expand(1, G, -1)
    rebuilt = sel._rebuild(shadow, rows, 1, torch.float32)
    exact = from_rows(cache.layers[1].k.data[:, :, : rows.shape[-1]], torch.float32)
    assert ((rebuilt - exact).norm() / exact.norm()) < 0.1  # one channel of G d dropped


def test_shadowkv_generates_under_its_budget_and_counts_its_bytes(tiny_models):
    """Every attended row counts in the budget; a step reads the landmarks, the basis and the rebuilt rows'
    coefficients besides the rows, fewer bytes than full's."""
    model = tiny_models["qwen2"]
    ids = torch.randint(3, 256, (2, 200), generator=torch.Generator().manual_seed(1))
    read = {}
    for method, options in [("shadowkv", dict(budget=0.25, min_budget=0, rank=8)), ("full", {})]:
        cache = ig.make_cache(method, model, **options)
        out = ig.generate(model, ids, cache=cache, max_new_tokens=8, stop_at_eos=False)
        assert out.tokens.shape == (2, 8)
        read[method] = cache.stats
    assert 0.2 < read["shadowkv"]["fetched_fraction"] <= 0.25 + 1 / 200
    assert read["shadowkv"]["kv_bytes_per_step"] < 0.5 * read["full"]["kv_bytes_per_step"]


def test_shadowkv_at_the_keys_width_reads_the_same_rows_in_place(tiny_models, monkeypatch):
    """rank >= G d: nothing rebuilt, the chosen rows read where they lie (counted, real first); the rows are those a
    low rank chooses (landmarks and outliers come from the keys after RoPE), at the first decode step."""
    model = tiny_models["llama-gqa"]
    ids, mask = left_padded_batch(lengths=(90, 70))
    real, seen = ShadowKVSelect.choose_at_query, {}

    def spy(self, c, layer, q, step):
        fetch = real(self, c, layer, q, step)
        seen.setdefault((self.rank, layer), fetch)
        return fetch

    monkeypatch.setattr(ShadowKVSelect, "choose_at_query", spy)
    for rank in (4, 160):
        cache = ig.make_cache("shadowkv", model, budget=0.3, min_budget=0, rank=rank, chunk=4, local=8)
        assert cache.selection.in_place == (rank == 160)
        step_logits(model, cache, ids, mask, steps=1)
    for layer in range(len(model.layers)):
        low, wide = seen[(4, layer)], seen[(160, layer)]
        assert wide.keys is None and wide.count is not None and low.keys is not None
        for b in range(2):
            for g in range(low.idx.shape[1]):
                assert (sorted(wide.idx[b, g, : wide.count[b, g]].tolist())
                        == sorted(low.idx[b, g][low.real[b, g]].tolist()))
