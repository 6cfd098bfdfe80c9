"""H2O: heavy hitters + recent window within the budget, evicted for good, exact when the budget covers all."""

import math

import pytest
import torch

import infinigen_kv as ig
from conftest import left_padded_batch


@pytest.mark.parametrize("chunk", [256, 7])  # one chunk of queries, or several (each over its causal keys)
def test_prefill_scores_are_attention_column_sums(tiny_models, monkeypatch, chunk):
    from infinigen_kv.model.arch import get_arch
    from infinigen_kv.methods import h2o
    from infinigen_kv.methods.infinigen.offline import collect_qk

    monkeypatch.setattr(h2o, "QUERY_CHUNK", chunk)
    model = tiny_models["llama-mha"]
    ids = torch.randint(3, 256, (1, 30))
    cache = ig.make_cache("h2o", model, budget=0.5, min_budget=0)
    with torch.inference_mode():
        model(ids, past_key_values=cache)
    arch = get_arch(model)
    qs, ks = collect_qk(model, arch, ids)  # (H, n, d) and (G, n, d) of every layer, post-RoPE
    s = qs[1] @ ks[1].transpose(-1, -2) * arch.score_scale  # one KV head per query head here
    s = s.masked_fill(torch.ones(30, 30, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.softmax(s, -1).sum(dim=1)  # (H, n): attention each key received, over all queries
    torch.testing.assert_close(cache.layers[1].score.valid()[0, :, :, 0], ref, atol=1e-4, rtol=1e-4)


def test_prefill_scores_stay_inside_a_sliding_window(monkeypatch):
    """A sliding-window layer (Mistral, window 16, 40 tokens): each chunk scores only the keys from its first
    query's window on, and the sums still equal the windowed attention's column sums."""
    from conftest import tiny_hf

    from infinigen_kv.model.arch import get_arch
    from infinigen_kv.model.weights import from_hf
    from infinigen_kv.methods import h2o
    from infinigen_kv.methods.infinigen.offline import collect_qk

    monkeypatch.setattr(h2o, "QUERY_CHUNK", 7)
    hf = tiny_hf("mistral")
    hf.config.sliding_window = 16
    model = from_hf(hf)
    if True:
        ids = torch.randint(3, 256, (1, 40))
        cache = ig.make_cache("h2o", model, budget=0.5, min_budget=0)
        assert cache.layers[1].window == 16  # the path under test: chunks start at their window's edge
        with torch.inference_mode():
            model(ids, past_key_values=cache)
        arch = get_arch(model)
        qs, ks = collect_qk(model, arch, ids)
        r = qs[1].shape[0] // ks[1].shape[0]
        s = qs[1] @ ks[1].repeat_interleave(r, 0).transpose(-1, -2) * arch.score_scale  # (H, n, n)
        i = torch.arange(40)
        seen = (i.view(1, -1) <= i.view(-1, 1)) & (i.view(1, -1) > i.view(-1, 1) - 16)
        p = torch.softmax(s.masked_fill(~seen, float("-inf")), -1).sum(dim=1)  # (H, n)
        ref = p.view(-1, r, 40).sum(1)  # summed over the query heads of a KV head
        torch.testing.assert_close(cache.layers[1].score.valid()[0, :, :, 0], ref, atol=1e-4, rtol=1e-4)


def _sums_path():
    from infinigen_kv.methods import h2o
    from infinigen_kv.model import backend

    b = backend.build("cpu")
    return b if b.ops is not None and (b.bf16_attention or b.path in h2o.FLOAT32_SUMS_PATHS) else None


@pytest.mark.skipif(_sums_path() is None, reason="no CPU kernels with AVX2 here (PyTorch's path serves)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G,r,d", [(2, 3, 64), (1, 4, 128), (3, 1, 16)])
@pytest.mark.parametrize("T,S", [(5, 40), (37, 300), (70, 1100)])
def test_float32_column_sums_match_float64(T, S, G, r, d, dtype):
    """kernels/column_sums.cpp: each key's probability summed over the chunk's causal queries and a group's heads,
    as float64 attention of the same inputs gives it; tiles and key blocks cut anywhere (T not a multiple of its
    16-position tiles, S not of its 16-key blocks)."""
    K = _sums_path().ops
    torch.manual_seed(T + S + d)
    q, k = torch.randn(T, G * r, d) * 2, torch.randn(G, S, d).to(dtype)
    s = torch.einsum("thc,hsc->hts", q.double(), k.double().repeat_interleave(r, dim=0)) * d**-0.5
    s = s.masked_fill(torch.arange(S)[None] > torch.arange(T)[:, None] + S - T, float("-inf"))
    want = torch.softmax(s, -1).sum(1).view(G, r, S).sum(1)  # (G, S)
    got = K.column_sums(q, k, d**-0.5)
    assert got.shape == (G, S) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(_sums_path() is None, reason="no CPU kernels with AVX2 here (PyTorch's path serves)")
def test_prefill_scores_over_a_long_past_in_the_kernel(monkeypatch):
    """A chunk over a long past (LONG_PAST keys or more, causal) is scored by a CPU kernel (in bfloat16 products
    where the layer's attention runs in those, else float32): the float32 path's column sums within that rounding,
    per sequence and KV head."""
    from types import SimpleNamespace

    from infinigen_kv.methods import h2o

    b = _sums_path()
    torch.manual_seed(3)
    B, H, G, T, n, d = 2, 6, 2, 70, 1200, 64
    q, k = torch.randn(B, H, T, d) * 2, torch.randn(B, G, n, d).bfloat16()
    causal = (torch.arange(n)[None] <= torch.arange(T)[:, None] + n - T)[None, None].repeat(B, 1, 1, 1)
    sums = []
    for long_past in (h2o.LONG_PAST, n):  # the kernel, then (the past no longer long) the float32 path
        monkeypatch.setattr(h2o, "LONG_PAST", long_past)
        layer = h2o.H2OLayer.__new__(h2o.H2OLayer)
        layer.window, layer.score = None, SimpleNamespace(data=torch.zeros(B, G, n + 5, 1))
        for mask in (None, causal):  # no mask, or the model's (causal) mask of a chunk over a past
            assert (layer._kernel_sums(q, k, mask, d**-0.5, b) is None) == (long_past == n)
        layer.add_prefill_scores(q, k, causal, d**-0.5, b)  # the model's mask of a chunk over a past: causal
        sums.append(layer.score.data[..., 0])
    tol = (2e-3, 1e-2) if b.bf16_attention else (1e-5, 1e-5)  # bfloat16 queries, or float32 throughout
    torch.testing.assert_close(sums[0], sums[1], atol=tol[0] * sums[1].max().item(), rtol=tol[1])
    assert sums[0][..., n:].abs().sum() == 0 and abs(sums[0].sum().item() - B * H * T) < 1e-2 * B * H * T
    padded = causal.clone()
    padded[1, ..., :5] = False  # a left-padded row: the float32 path, under the mask
    assert layer._kernel_sums(q, k, padded, d**-0.5, b) is None


def test_h2o_caches_in_one_tee_score_the_prefill_once(tiny_models, monkeypatch):
    """H2O at several budgets sharing one prefill (bench accuracy's TeeCache): the column sums are computed once a
    layer and chunk, and each cache holds the scores an H2O cache prefilled alone holds."""
    from infinigen_kv.bench.tee import TeeCache
    from infinigen_kv.methods import h2o

    model = tiny_models["llama-gqa"]
    ids = torch.randint(3, 256, (1, 40))
    alone = ig.make_cache("h2o", model, budget=0.5, min_budget=0)
    caches = [ig.make_cache("h2o", model, budget=b, min_budget=0) for b in (0.5, 0.25)]
    with torch.inference_mode():
        model(ids, past_key_values=alone)
        calls = []
        real = h2o.H2OLayer.prefill_column_sums
        monkeypatch.setattr(h2o.H2OLayer, "prefill_column_sums", lambda *a: calls.append(1) or real(*a))
        model(ids, past_key_values=TeeCache([ig.make_cache("full", model), *caches]))
    assert len(calls) == len(model.layers)
    for cache in caches:
        for mine, ref in zip(cache.layers, alone.layers):
            assert torch.equal(mine.score.valid(), ref.score.valid())


def test_keeps_heavy_hitters_and_recent(tiny_models):
    model = tiny_models["llama-gqa"]
    ids, mask = left_padded_batch(lengths=(40,))
    cache = ig.make_cache("h2o", model, budget=0.5, min_budget=0)
    with torch.inference_mode():
        model(ids, attention_mask=mask, past_key_values=cache)
        layer = cache.layers[2]
        # hand-made pattern: positions 3, 7, 11 are the heavy hitters of KV head 0
        layer.score.data[:, :, :40, 0] = 0.0
        layer.score.data[0, 0, [3, 7, 11], 0] = torch.tensor([5.0, 4.0, 3.0])
        model(torch.tensor([[9]]), attention_mask=torch.ones(1, 41, dtype=torch.long), past_key_values=cache,
              position_ids=torch.tensor([[40]]))
    cap = math.ceil(0.5 * 41)  # 21 entries after the first decode token
    kept = sorted(layer.pos.valid()[0, 0, : int(layer.kept[0]), 0].tolist())
    assert len(kept) == cap
    assert {3, 7, 11} <= set(kept)  # heavy hitters survive
    recent = int(cap * 0.5)
    assert set(range(41 - recent, 41)) <= set(kept)  # the recent window survives


def test_budget_held_during_decode(tiny_models):
    model = tiny_models["opt"]
    ids, mask = left_padded_batch(lengths=(50, 33))
    cache = ig.make_cache("h2o", model, budget=0.2, min_budget=0)
    ig.generate(model, ids, mask, cache=cache, max_new_tokens=12, stop_at_eos=False)
    for layer in cache.layers:
        assert layer.kept.tolist() == [math.ceil(0.2 * (50 + 11)), math.ceil(0.2 * (33 + 11))]
