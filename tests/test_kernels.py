"""The CPU kernels (model/kernels/) against plain PyTorch, and the decode path with and without them."""

import json
import math
import os
import time

import pytest
import torch

import infinigen_kv as ig
from infinigen_kv.model import backend, kernels
from infinigen_kv.model.kv import from_rows
from infinigen_kv.methods.infinigen.speculator import relative
from conftest import KINDS, left_padded_batch, tiny_model
from test_exactness import step_logits

K = kernels.library()
pytestmark = pytest.mark.skipif(K is None, reason="CPU kernels could not be built (no C++ compiler)")


def reference_attention(q, Kp, Vp, rows, scale):
    """q (r, d) over the pool rows `rows` of one (sequence, head) (stored rows: int8 ones read by their scale): (r, d)."""
    k, v = from_rows(Kp[rows], torch.float32), from_rows(Vp[rows], torch.float32)
    return torch.softmax(q @ k.T * scale, -1) @ v


def bf16_products(Kp, rows, heads, pairs_upto: int = 0) -> bool:
    """Whether attend (given pairs_upto, as these tests call it: 0) multiplies these rows in bfloat16 pairs
    (kernels/bf16_dots.h: bfloat16 rows of a multiple of 64 channels, BF16_ATTEND_ROWS of them or more, `heads` query
    heads a KV head up to pairs_upto): the query and the probabilities then round to bfloat16, a relative error of
    ~1e-3 (tests/test_attend_bf16_rows.py holds them to it, and the float32 products to 1e-5)."""
    most = K.BF16_ATTEND_ROWS
    return (most is not None and Kp.dtype == torch.bfloat16 and Kp.shape[-1] % 64 == 0 and rows.numel() >= most
            and heads <= pairs_upto)


def stored(x: torch.Tensor, dtype) -> torch.Tensor:
    """x (..., d) float32 as pool rows of `dtype` (int8: d values and their scale)."""
    return K.quantize_kv_rows(x) if dtype == torch.int8 else x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("d", [64, 40])  # a compiled size and a run-time one
def test_attend_selected_rows(dtype, d):
    torch.manual_seed(0)
    B, G, r, cap, n, m = 2, 3, 3, 700, 600, 300
    q = torch.randn(B, G, r, d)
    Kp, Vp = stored(torch.randn(B, G, cap, d), dtype), stored(torch.randn(B, G, cap, d), dtype)
    idx = torch.randint(0, n, (B, G, m))
    count = torch.randint(1, m + 1, (B, G))
    new = torch.randint(0, n, (B, G))
    out = K.attend(q, Kp, Vp, idx, count, new, -1, None, 0, 0.125, torch.float32)
    for b in range(B):
        for g in range(G):
            rows = torch.cat([new[b, g : g + 1], idx[b, g, : count[b, g]]])
            tol = 1e-2 if bf16_products(Kp, rows, r) else 1e-5
            torch.testing.assert_close(out[b, g], reference_attention(q[b, g], Kp[b, g], Vp[b, g], rows, 0.125),
                                       rtol=tol, atol=tol)
    # the new token as one slot for all rows, all m slots real
    out = K.attend(q, Kp, Vp, idx, None, None, n, None, 0, 0.125, torch.float32)
    rows = torch.cat([torch.tensor([n]), idx[1, 2]])
    tol = 1e-2 if bf16_products(Kp, rows, r) else 1e-5
    torch.testing.assert_close(out[1, 2], reference_attention(q[1, 2], Kp[1, 2], Vp[1, 2], rows, 0.125),
                               rtol=tol, atol=tol)


def test_attend_selected_rows_alone_or_in_a_batch():
    """Chosen rows are cut into even chunks of the row's own count (1,024 + the new token: 5 x 208, not 512 + 512 +
    1): a row's result is the same bits alone or beside rows of other counts, and matches the softmax."""
    torch.manual_seed(6)
    G, r, d, cap, n, m = 3, 3, 64, 1300, 1250, 1024
    q = torch.randn(3, G, r, d)
    Kp, Vp = torch.randn(3, G, cap, d), torch.randn(3, G, cap, d)
    idx = torch.stack([torch.randperm(n)[:m] for _ in range(3 * G)]).view(3, G, m)
    count = torch.tensor([[m, 700, 257], [1, 513, m], [300, 40, 999]])
    new = torch.full((3, G), n)
    batch = K.attend(q, Kp, Vp, idx, count, new, -1, None, 0, 0.125, torch.float32)
    for b in range(3):
        one = [t[b : b + 1].contiguous() for t in (q, Kp, Vp, idx, count, new)]
        assert torch.equal(K.attend(*one[:3], one[3], one[4], one[5], -1, None, 0, 0.125, torch.float32)[0], batch[b])
        for g in range(G):
            rows = torch.cat([new[b, g : g + 1], idx[b, g, : count[b, g]]])
            torch.testing.assert_close(batch[b, g], reference_attention(q[b, g], Kp[b, g], Vp[b, g], rows, 0.125),
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", [64, 40, 16, 256])  # whole groups of 32, a shorter last group, one short group
def test_int8_kv_rows_kernel_matches_pytorch(d, monkeypatch):
    """int8 K/V rows (model/int8_rows.py: q8_0's groups of 32 with float16 scales): the kernel's quantizer gives the
    PyTorch one's bytes, the values read back within half a step of their group, an all-zero group reads zeros."""
    from infinigen_kv.model import int8_rows

    torch.manual_seed(8)
    x = torch.randn(3, 5, d) * torch.rand(3, 5, 1) * 4
    x[0, 1, :] = 0
    x[1, 2, : min(d, 32)] = 0
    rows = K.quantize_kv_rows(x)
    assert rows.shape == (3, 5, int8_rows.kv_width(d)) and int8_rows.kv_dim(rows.shape[-1]) == d
    monkeypatch.setattr(int8_rows, "library", lambda: None)  # the codec's PyTorch path
    assert torch.equal(int8_rows.pack_kv(x), rows)
    back = int8_rows.unpacked_kv(rows, torch.float32)
    groups = torch.nn.functional.pad(x, (0, -d % 32)).view(3, 5, -1, 32).abs().amax(-1)  # (3, 5, groups)
    step = groups.repeat_interleave(32, -1)[..., :d] / 127
    assert ((back - x).abs() <= step * 0.5 * 1.01 + 1e-12).all()
    assert not back[0, 1].any() and not back[1, 2, : min(d, 32)].any()


def int8_activations(x: torch.Tensor) -> tuple:
    """x (R, in) as the int8 weight rows' decode product takes it (llama.cpp's q8_0 activations): per group of 32
    values (the last one zero-padded) int8 levels of absmax / 127, rounded half to even, and the groups' scales:
    (levels (R, groups, 32), scales (R, groups, 1))."""
    R, inputs = x.shape
    groups = torch.nn.functional.pad(x, (0, -inputs % 32)).view(R, -1, 32)
    m = groups.abs().amax(-1, keepdim=True)
    levels = torch.round(groups * torch.where(m > 0, 127.0 / m, torch.zeros_like(m))).clamp(-127, 127)
    return levels, m / 127


@pytest.mark.parametrize("inputs", [576, 40, 300])  # whole groups (eight at a time and alone), a short last group
def test_int8_weight_rows_linear(inputs, monkeypatch):
    """`linear` over int8 weight rows and int8 tiles (--weights int8; tiles where the rows are whole groups: 37 rows
    are two tiles and five rows): the products of the int8 activations (int8_activations) and the weights' levels
    summed exactly, times the groups' scales (within float32's rounding), and so within the activations' rounding of
    the float product; the rows dequantized by the kernel as by PyTorch; a row's result whatever rows share the
    call, with a bias and a residual."""
    from infinigen_kv.model import int8_rows, int8_tiles

    torch.manual_seed(9)
    W = torch.randn(37, inputs) * torch.rand(37, 1)
    W[3, :32] = 0  # a zero group
    rows = int8_rows.pack_kv(W)
    x = torch.randn(21, inputs) * 3  # blocks of 8 rows, 4 and 1
    x[2, :32] = 0  # a zero group of activations
    dense = K.dequantize_kv_rows(rows, inputs)
    levels, scales = int8_activations(x)
    wg = torch.nn.functional.pad(dense, (0, -inputs % 32)).view(37, -1, 32).double()
    exact = torch.einsum("rgi,ogi,rg->ro", levels.double(), wg, scales[..., 0].double())
    ref = torch.nn.functional.linear(x, dense)
    held = [rows] + ([int8_tiles.tiled(rows)] if int8_tiles.fits(inputs) else [])
    for w in held:
        y = K.linear(x, w, None, None)
        assert (y.double() - exact).abs().max() <= 1e-6 * exact.abs().max()
        assert (y - ref).abs().max() <= 0.5 / 127 * (x.abs() @ dense.abs().t()).max()
        for a, b in ((0, 1), (0, 2), (0, 4), (0, 5), (0, 8), (3, 4), (5, 19)):
            assert torch.equal(K.linear(x[a:b].contiguous(), w, None, None), y[a:b])
        bias, res = torch.randn(37), torch.randn(21, 37)
        assert torch.equal(K.linear(x, w, bias, res), res + (y + bias))
    if len(held) > 1:  # tiles: the rows' bytes moved, read back exactly; their values as the rows'
        assert torch.equal(int8_tiles.rows_of(held[1]), rows)
        ids = torch.tensor([[0, 17], [36, 5]])  # in tiles and after them
        assert torch.equal(int8_tiles.rows_at(held[1], ids), rows[ids])
        assert torch.equal(int8_tiles.unpacked(held[1]), dense)
        assert torch.equal(int8_tiles.unpacked(held[1], torch.bfloat16), dense.bfloat16())
        monkeypatch.setattr(int8_tiles, "library", lambda: None)
        assert torch.equal(int8_tiles.unpacked(held[1]), dense)
    monkeypatch.setattr(int8_rows, "library", lambda: None)  # the codec's PyTorch path
    assert torch.equal(int8_rows.unpacked_kv(rows, torch.float32), dense)


def test_int6_tiles_linear(monkeypatch):
    """`linear` over int6 tiles (a GGUF's Q6_K blocks, 32 rows of two super-blocks): per group the exact integer sum of
    sc (q - 32) x over the int8 activations, times d and the activations' scale (within float32's rounding); a row's
    result whatever rows share the call, with a bias and a residual; the tiles' values (kernel and PyTorch) the
    file's."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    from infinigen_kv.model import int6_tiles
    from infinigen_kv.testing.gguf import quantize_q6_k

    rs = np.random.RandomState(3)
    blocks = quantize_q6_k((rs.randn(32, 512) * rs.rand(32, 1)).astype(np.float32))
    want = torch.from_numpy(dequantize(blocks.reshape(-1), T.Q6_K).astype(np.float32)).view(32, 512)
    held = int6_tiles.tiled(torch.from_numpy(blocks))
    assert torch.equal(int6_tiles.unpacked(held), want) and torch.equal(int6_tiles.reference_unpacked(held), want)
    assert torch.equal(int6_tiles.unpacked(held, torch.bfloat16), want.bfloat16())
    x = torch.randn(21, 512) * 3
    levels, scales = int8_activations(x)
    exact = torch.einsum("rgi,ogi,rg->ro", levels.double(), want.view(32, -1, 32).double(), scales[..., 0].double())
    y = K.linear(x, held, None, None)
    assert (y.double() - exact).abs().max() <= 1e-6 * exact.abs().max()
    for a, b in ((0, 1), (0, 4), (0, 8), (3, 4), (5, 19)):
        assert torch.equal(K.linear(x[a:b].contiguous(), held, None, None), y[a:b])
    bias, res = torch.randn(32), torch.randn(21, 32)
    assert torch.equal(K.linear(x, held, bias, res), res + (y + bias))
    monkeypatch.setattr(int6_tiles, "library", lambda: None)
    assert torch.equal(int6_tiles.unpacked(held), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_store_token_writes_what_the_separate_appends_write(dtype):
    """store_token: a decode token's K and V rows (strided views, as the own step hands them; int8 rows quantized
    in groups with their scales) and its int8 partial row into a pool layer at one slot, the same bytes as copies and
    quantize_kv_rows / quantize_rows of the rows and of the gathered channels."""
    torch.manual_seed(7)
    B, G, H, d, p, cap, at = 2, 3, 9, 64, 32, 50, 17
    qkv = torch.randn(B, H + 2 * G, 1, d)  # the merged projection's output, viewed per head
    k, v = qkv[:, H : H + G], qkv[:, H + G :]
    channels = torch.stack([torch.randperm(d)[:p] for _ in range(G)])
    w = d + 4 if dtype == torch.int8 else d  # two groups of 32, a float16 scale each
    Kb, Vb = torch.zeros(B, G, cap, w, dtype=dtype), torch.zeros(B, G, cap, w, dtype=dtype)
    Pb = torch.zeros(B, G, cap, p + 4, dtype=torch.int8)
    K.store_token(Kb, Vb, Pb, k, v, channels, at)
    assert torch.equal(Kb[:, :, at], stored(k[:, :, 0].contiguous(), dtype))
    assert torch.equal(Vb[:, :, at], stored(v[:, :, 0].contiguous(), dtype))
    part = k.gather(-1, channels.view(1, G, 1, p).expand(B, G, 1, p)).contiguous()
    assert torch.equal(Pb[:, :, at : at + 1], K.quantize_rows(part))
    assert not Kb[:, :, :at].any() and not Pb[:, :, at + 1 :].any()  # nothing else written
    with pytest.raises(RuntimeError, match="bad shapes"):
        K.store_token(Kb, Vb, Pb, k, v, channels, cap)


def test_decode_stores_a_token_in_one_kernel_call(tiny_models, monkeypatch):
    """With int8 partial keys a decode step stores each pool layer's token through store_token, and the cache holds
    the bytes the separate appends would have written (the same logits, rows and partial rows)."""
    from infinigen_kv.methods.infinigen.layer import PoolLayer

    model = tiny_models["llama-gqa"]
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    calls = []
    store = K.store_token
    monkeypatch.setattr(K, "store_token", lambda *a: calls.append(1) or store(*a))
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(PoolLayer, "append_token", lambda self, k, v: False)
        cache = ig.make_cache("infinigen", model, partial_dtype="int8", alpha=4.0, budget=0.3, min_budget=0)
        runs.append((step_logits(model, cache, ids, mask, steps=4), cache.layers[2]))
    pool_layers = model.config.n_layers - 1  # layer 0 is dense, without partial keys
    assert len(calls) == 4 * pool_layers
    assert torch.equal(runs[0][0], runs[1][0])
    (_, a), (_, b) = runs
    for x, y in ((a.k, b.k), (a.v, b.v), (a.partial, b.partial)):
        assert x.length == y.length and torch.equal(x.valid(), y.valid())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("r,d", [(4, 64), (7, 64), (12, 128)])  # bfloat16 rows: one pass of heads, two of them
def test_attend_dense_with_mask(dtype, r, d):
    torch.manual_seed(1)
    B, G, cap, n = 2, 2, 1100, 1000  # long enough to be split across threads
    q = torch.randn(B, G, r, d)
    Kp, Vp = stored(torch.randn(B, G, cap, d), dtype), stored(torch.randn(B, G, cap, d), dtype)
    keep = torch.rand(B, 1, n) > 0.3
    out_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    out = K.attend(q, Kp, Vp, None, None, None, -1, keep, n, 0.1, out_dtype)
    k, v = from_rows(Kp[:, :, :n], torch.float32), from_rows(Vp[:, :, :n], torch.float32)
    s = (q @ k.transpose(-1, -2) * 0.1).masked_fill(~keep.unsqueeze(2), float("-inf"))
    ref = torch.softmax(s, -1) @ v
    assert out.dtype == out_dtype
    torch.testing.assert_close(out.float(), ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("combine", ["max", "mean"])
@pytest.mark.parametrize("alpha,k", [(3.0, 60), (3.0, 5000), (50.0, 25)])  # cap binds or not
@pytest.mark.parametrize("r", [3, 1, 2, 4])  # query heads per KV head: scored in groups of up to 3 heads
def test_speculate_matches_threshold_and_cap(combine, alpha, k, r):
    torch.manual_seed(2)
    B, G, p, cap, n = 2, 3, 32, 600, 502
    q = torch.randn(B, G, r, p)
    kp = torch.randn(B, G, cap, p)
    keep = torch.rand(B, 1, n) > 0.2
    caps = torch.tensor([[40], [1000]]).expand(B, G).contiguous()  # sequence 0 capped lower
    idx, count, total = K.speculate(q, kp, n, keep, caps, 0.125, alpha, k,
                                    combine == "mean")
    assert total == int(count.sum())  # the host's tally of the step's fetch
    rel = relative(q @ kp[:, :, :n].transpose(-1, -2) * 0.125, keep, combine)  # (B, G, n)
    within = (rel > -alpha).sum(-1)
    expect = torch.minimum(torch.minimum(within, caps), torch.tensor(k)).clamp(min=1)
    assert torch.equal(count, expect)
    for b in range(B):
        for g in range(G):
            c = int(count[b, g])
            chosen = idx[b, g, :c]
            assert len(set(chosen.tolist())) == c and bool(keep[b, 0, chosen].all())
            assert math.isclose(rel[b, g, chosen].min().item(), rel[b, g].topk(c).values.min().item(), rel_tol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_speculate_breaks_ties_at_the_cap_by_age_in_position_order(dtype):
    """The cap-th value shared by more tokens than fit: those above it, then the oldest of those equal to it; the
    chosen slots always in position order (the binding cap's histogram path and the plain one)."""
    B, G, r, p, n, k = 1, 2, 3, 32, 203, 40
    kp = torch.zeros(B, G, n + 5, p)
    kp[..., 0] = 1.0  # every key alike: equal scores
    best = torch.tensor([150, 80, 199, 60])  # a few keys score higher
    kp[:, :, best, 0] = 2.0
    rows = K.quantize_rows(kp) if dtype == torch.int8 else kp
    q = torch.ones(B, G, r, p)
    keep = torch.ones(B, 1, n, dtype=torch.bool)
    keep[0, 0, :3] = False  # padding is never chosen, even among ties
    idx, count, _ = K.speculate(q, rows, n, keep, None, 0.125, 8.0, k, False)
    expect = sorted(best.tolist() + list(range(3, 3 + k - len(best))))
    assert count.tolist() == [[k, k]]
    for g in range(G):
        assert idx[0, g].tolist() == expect
    idx, count, _ = K.speculate(q, rows, n, None, None, 0.125, 8.0, n, False)  # the cap does not bind: all of them
    assert count.tolist() == [[n, n]] and idx[0, 0].tolist() == list(range(n))


@pytest.mark.parametrize("p", [32, 64, 24])  # the vector path (multiples of 32) and the plain one
def test_int8_partial_keys_kernel_matches_pytorch(p):
    """int8 partial key rows (model/int8_rows.py): the kernel's quantizer gives the PyTorch one's bytes, and its selection
    (integer dot products) the PyTorch scores' to the slot, every row length mod 8 included."""
    from infinigen_kv.methods.infinigen import int8
    from infinigen_kv.methods.infinigen.speculator import select
    from infinigen_kv.model import int8_rows

    torch.manual_seed(5)
    B, G, r, cap, n, k = 2, 3, 3, 420, 413, 50
    x = torch.randn(B, G, cap, p) * torch.rand(B, G, cap, 1) * 4
    x[0, 0, 7] = 0  # an all-zero row: scale 0, values 0
    rows = K.quantize_rows(x)
    values, scale = int8_rows.quantize(x)
    assert rows.shape == (B, G, cap, p + 4) and rows.dtype == torch.int8
    assert torch.equal(rows, torch.cat([values.to(torch.int8), scale.view(torch.int8)], -1))
    kv, sk = int8_rows.unpack(rows)
    torch.testing.assert_close(kv * sk.unsqueeze(-1), x, atol=float(x.abs().max()) / 127, rtol=0)  # within a step
    q = torch.randn(B, G, r, p)
    keep = torch.rand(B, 1, n) > 0.1
    caps = torch.tensor([[40], [1000]]).expand(B, G).contiguous()
    idx, count, _ = K.speculate(q, rows, n, keep, caps, 0.125, 4.0, k, False)
    scores = int8.scores(q, rows[:, :, :n], 0.125)  # (B, G, r, n)
    e_idx, e_count = select(scores, keep, 4.0, 1.0, k)
    assert torch.equal(count, torch.minimum(e_count, caps))
    for b in range(B):
        for g in range(G):
            c = int(count[b, g])
            assert sorted(idx[b, g, :c].tolist()) == sorted(e_idx[b, g, :c].tolist())


def test_int8_partial_keys_decode(tiny_models, monkeypatch):
    """partial_dtype="int8": rows of p + 4 bytes in the cache, budget 1.0 exact, and at a binding budget the same
    fetches through the kernels as through the PyTorch path (padded batch)."""
    model = tiny_models["llama-gqa"]
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    ref = step_logits(model, ig.make_cache("full", model), ids, mask)
    cache = ig.make_cache("infinigen", model, partial_dtype="int8", budget=1.0, alpha=1e9)
    torch.testing.assert_close(step_logits(model, cache, ids, mask), ref, atol=1e-4, rtol=1e-4)
    layer = cache.layers[1]
    assert layer.partial.data.dtype == torch.int8 and layer.partial.width == layer.skew_p.shape[-1] + 4
    runs = []
    for on in (True, False):
        monkeypatch.setattr(model, "backend", backend.build("cpu", kernels=on))
        cache = ig.make_cache("infinigen", model, partial_dtype="int8", alpha=4.0, budget=0.3, min_budget=0)
        runs.append((step_logits(model, cache, ids, mask), cache.stats["fetched_fraction_per_layer"]))
    torch.testing.assert_close(runs[0][0], runs[1][0], atol=1e-4, rtol=1e-4)
    assert runs[0][1] == pytest.approx(runs[1][1]) and min(runs[0][1][1:]) < 0.5


@pytest.mark.parametrize("kind", KINDS)
def test_decode_same_with_and_without_kernels(tiny_models, kind, monkeypatch, tmp_path):
    """Through the kernels and through the PyTorch path: the same selections and logits at a budget that
    binds (padded batch, every architecture); the full cache too. A calibration cache of its own, made here: the one
    another test leaves at the default path moved the selections' margins with the suite's order."""
    monkeypatch.setenv("INFINIGEN_CACHE_DIR", str(tmp_path))
    model = tiny_models[kind]
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setattr(model, "backend", backend.build("cpu", kernels=flag == "1"))
        # partial keys in the model's dtype on both paths ("auto" stores int8 rows only for the kernel)
        cache = ig.make_cache("infinigen", model, alpha=4.0, budget=0.3, min_budget=0, partial_dtype="model")
        runs[flag] = (step_logits(model, cache, ids, mask), step_logits(model, ig.make_cache("full", model), ids, mask),
                      cache.stats["fetched_fraction_per_layer"])
    (ig_k, full_k, frac_k), (ig_t, full_t, frac_t) = runs["1"], runs["0"]
    torch.testing.assert_close(full_k, full_t, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ig_k, ig_t, atol=1e-4, rtol=1e-4)
    assert frac_k == pytest.approx(frac_t) and min(frac_k[1:]) < 0.5  # same fetches, and the budget binds


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 8, 13])  # every block size (8, 4, 2, 1) and their tails
@pytest.mark.parametrize("width", [37, 64])  # an input width that is not a multiple of 8, and one that is
def test_linear(rows, dtype, width):
    torch.manual_seed(3)
    W = torch.randn(50, width).to(dtype)
    x, bias = torch.randn(rows, width), torch.randn(50)
    expect = torch.nn.functional.linear(x, W.float(), bias)
    torch.testing.assert_close(K.linear(x, W, bias), expect, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(K.linear(x, W, None), expect - bias, rtol=1e-5, atol=1e-5)
    res = torch.randn(rows, 50)  # the residual add of a decode layer, fused: the bits of res + linear
    assert torch.equal(K.linear(x, W, bias, res), res + K.linear(x, W, bias))


@pytest.mark.parametrize("rows, F", [(1, 1536), (3, 1013), (8, 24), (2, 7)])  # vectors and every kind of tail
def test_silu_mul_has_pytorchs_bits(rows, F):
    torch.manual_seed(4)
    gu = torch.randn(rows, 2 * F) * torch.logspace(-4, 2, 2 * F)  # tiny to saturated
    expect = torch.nn.functional.silu(gu[:, :F].contiguous()) * gu[:, F:]  # the model's gate_proj output
    assert torch.equal(K.silu_mul(gu, kernels.silu_lanes()), expect) and kernels.silu_mul_exact(K)


@pytest.mark.parametrize("d", [64, 128, 40])
def test_rope_in_place_has_transformers_bits(d):
    from infinigen_kv.model.rope import apply_rope

    torch.manual_seed(5)
    B, heads, rotated = 3, 15, 12  # q and k rotated, v left alone
    x = torch.randn(B, heads * d) * 10
    cos, sin = torch.randn(B, 1, d), torch.randn(B, 1, d)
    before = x.clone().view(B, 1, heads, d).transpose(1, 2)
    K.rope_(x, cos, sin, rotated)
    after = x.view(B, 1, heads, d).transpose(1, 2)
    assert torch.equal(after[:, :rotated], apply_rope(before[:, :rotated], (cos, sin)))
    assert torch.equal(after[:, rotated:], before[:, rotated:])


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
@pytest.mark.parametrize("lengths", [(30,), (30, 22)])  # one decode row, two
def test_held_weights_through_the_kernels_match_float32(lengths, weights, float32_products):
    """Decode through the `linear` kernel over held weights (bfloat16, int8 rows) equals the float32 model of the
    values they hold (the prompt multiplied in float32 too); int8 rows within their int8 activations' rounding (2^-8
    of a group's largest value, as llama.cpp's q8_0 products)."""
    from infinigen_kv.model.ops import dense

    held = tiny_model("qwen2", weights=weights)  # biases too
    ref = tiny_model("qwen2")
    with torch.no_grad():
        for (name, p), (_, q) in zip(held.named_parameters(), ref.named_parameters()):
            q.copy_(dense(p, torch.float32))
    float32_products(held, ref)
    ids, mask = left_padded_batch(lengths=lengths)
    torch.testing.assert_close(step_logits(held, ig.make_cache("full", held), ids, mask),
                               step_logits(ref, ig.make_cache("full", ref), ids, mask),
                               **(dict(atol=1e-2, rtol=1e-2) if weights == "int8" else dict(atol=1e-4, rtol=1e-4)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8"])
def test_partial_query_kernel(tiny_models, kind, weights, monkeypatch):
    """The partial query through the kernel (only the q_proj rows of P and their RoPE partners; the folded
    weights without RoPE) equals the full query's skewed channels (int8 weights: within the activations' rounding;
    bfloat16 rows where the CPU multiplies bfloat16: within x's bfloat16 rounding, a query that only ranks tokens),
    and so does the partial query taken from the layer's own query (speculate_from "own": PartialQuery.of_query)."""
    model = tiny_model(kind, weights=None if weights == "float32" else weights)
    cache = ig.make_cache("infinigen", model)
    # tiny RoPE models calibrate unskewed ("auto"); a QK-norm needs whole heads: no row kernel
    assert (cache.pq.rows is not None) == (cache.arch.rope and not cache.arch.qk_norm)
    torch.manual_seed(4)
    B, D, d = 3, cache.arch.hidden_size, cache.arch.head_dim
    x = torch.randn(B, 1, D)
    angle = torch.randn(B, 1, d // 2).repeat(1, 1, 2)
    ropes = [(angle.cos(), angle.sin()), (angle[:1].cos(), angle[:1].sin())] if cache.arch.rope else [None]
    with torch.no_grad():
        for layer, rope in [(1, ropes[0]), (len(cache.layers) - 1, ropes[-1])]:  # RoPE per row, or one for all
            cache.layers[layer].skew_p = cache.skew_partial[layer]
            got = cache.partial_query(layer, x, rope, {})
            expect = cache.pq(layer, x, rope, cache.layers[layer].skew_p, {}, backend.reference())
            own = cache.pq.of_query(cache.arch.query(layer, x, rope, model.backend), cache.layers[layer].skew_p)
            if weights == "int8":  # int8 rows: the kernel's int8 activations (2^-8 of a group) against float ones
                for y in (got, own):
                    assert (y - expect).norm() / expect.norm() < 1e-2
                continue
            tol = 1e-5
            if weights == "bfloat16" and K.bf16_dots_native():  # its rows', or (QK-norm) the whole query's
                tol = 2e-2
            torch.testing.assert_close(got, expect, rtol=tol, atol=tol)
            if weights == "bfloat16" and K.bf16_dots_native():  # the query's own linear rounds x to bfloat16 too
                tol = 2e-2
            torch.testing.assert_close(own, expect, rtol=tol, atol=tol)


def test_partial_key_storage(tiny_models, monkeypatch):
    """Partial keys as int8 rows where the CPU kernel scores them ("auto"), in bfloat16 when asked, in the model's
    dtype for "model" and on the PyTorch path; budget 1.0 stays exact either way."""
    model = tiny_models["llama-gqa"]
    ids, mask = left_padded_batch()
    ref = step_logits(model, ig.make_cache("full", model), ids, mask)
    for option, kernel, expect in [("auto", True, torch.int8), ("bfloat16", True, torch.bfloat16),
                                   ("model", True, torch.float32), ("auto", False, torch.float32)]:
        if not kernel:
            monkeypatch.setattr(model, "backend", backend.reference())
        cache = ig.make_cache("infinigen", model, partial_dtype=option, budget=1.0, alpha=1e9)
        torch.testing.assert_close(step_logits(model, cache, ids, mask), ref, atol=1e-4, rtol=1e-4)
        assert cache.layers[1].partial.data.dtype == expect
        monkeypatch.undo()


def test_bf16_weights_default():
    """Weight-only bfloat16 is the CPU default where the kernels can read it; float32 when asked or without them."""
    from infinigen_kv.model.load import bf16_weights

    cpu, cuda = backend.build("cpu"), backend.build("cuda")
    assert bf16_weights(None, cpu) and bf16_weights("bf16-weights", cpu)
    assert not bf16_weights("float32", cpu) and not bf16_weights(None, cuda)
    assert not bf16_weights(None, backend.reference()) and bf16_weights("bf16-weights", backend.reference())


@pytest.mark.parametrize("kind,weights", [("llama-gqa", "bfloat16"), ("gemma3", "bfloat16"), ("opt", "bfloat16"),
                                          ("gemma3", "int8"), ("opt", "int8")])
def test_weights_are_held_once(kind, weights):
    """bf16-weights holds the linear and embedding weights once, in bfloat16, --weights int8 as int8 tiles (rows of
    whole groups; int8 rows for others, and for an embedding apart from the LM head, which is looked up a row at a
    time: a tied LM head stays the embedding); norms, biases and positions stay float32, and the bytes model counts
    what is held."""
    from infinigen_kv.bench.report import weight_bytes
    from infinigen_kv.model import int8_tiles
    from infinigen_kv.model.int8_rows import kv_width
    from infinigen_kv.model.load import model_dtype

    ref, model = tiny_model(kind), tiny_model(kind, weights=weights)
    assert model_dtype(model) == {"bfloat16": "bf16-weights", "int8": "int8-weights"}[weights]
    assert (model.lm_head is model.embed) == (ref.lm_head is ref.embed) == model.args.tie_embeddings
    size = {"bfloat16": lambda w: 2 * w.numel(), "int8": lambda w: w.shape[0] * kv_width(w.shape[1])}[weights]
    saved = 0
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        matrix = name == "embed" or name.endswith(("wqkv.weight", "wo.weight", "w1.weight", "w2.weight")) or (
            name == "lm_head")
        dtype = torch.bfloat16 if weights == "bfloat16" else (
            int8_tiles.DTYPE if int8_tiles.fits(q.shape[-1]) and (name != "embed" or model.args.tie_embeddings)
            else torch.int8)
        assert p.dtype == (dtype if matrix else torch.float32), name
        saved += 4 * q.numel() - size(q) if matrix else 0
    assert weight_bytes(model) == weight_bytes(ref) - saved
    assert model.embed_tokens(torch.tensor([[3, 4]]), torch.tensor([[0, 1]])).dtype == torch.float32


def test_env_switch_read_at_start_up():
    """INFINIGEN_KERNELS=0 (a user setting, read when a model's backend is built at load) gives the reference
    backend; load_model(kernels=False) the same without the environment."""
    import subprocess
    import sys

    code = ("import infinigen_kv as ig; from infinigen_kv.model import backend; "
            "assert backend.build('cpu').name == 'reference'; print('off')")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "INFINIGEN_KERNELS": "0"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "off" in out.stdout, out.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_batch_invariant(dtype):
    """A row's attention and selection are the same bits alone and left-padded in a batch with another row:
    the kernels' work split and vector blocks depend on the row's own tokens only."""
    torch.manual_seed(4)
    G, r, d, p, n, pad = 3, 3, 64, 32, 1300, 37  # several split chunks; n and n + pad differ mod 8
    q, qp = torch.randn(1, G, r, d), torch.randn(1, G, r, p)
    k, v, kp = torch.randn(1, G, n, d).to(dtype), torch.randn(1, G, n, d).to(dtype), torch.randn(1, G, n, p).to(dtype)

    def padded(x, other):  # row 0: x behind `pad` junk rows; row 1: another sequence
        return torch.cat([torch.cat([torch.randn(1, G, pad, x.shape[-1]).to(dtype), x], 2), other], 0).contiguous()

    K2, V2, KP2 = (padded(t, torch.randn(1, G, n + pad, t.shape[-1]).to(dtype)) for t in (k, v, kp))
    keep1, keep2 = torch.ones(1, 1, n, dtype=torch.bool), torch.ones(2, 1, n + pad, dtype=torch.bool)
    keep2[0, 0, :pad] = False
    q2, qp2 = torch.cat([q, torch.randn(1, G, r, d)]), torch.cat([qp, torch.randn(1, G, r, p)])
    alone = K.attend(q, k.contiguous(), v.contiguous(), None, None, None, -1, keep1, n, 0.125, torch.float32)
    batch = K.attend(q2, K2, V2, None, None, None, -1, keep2, n + pad, 0.125, torch.float32)
    assert torch.equal(alone[0], batch[0])
    caps1 = torch.full((1, G), 130)
    caps2 = torch.tensor([[130], [133]]).expand(2, G).contiguous()
    i1, c1, _ = K.speculate(qp, kp.contiguous(), n, keep1, caps1, 0.125, 8.0, 133, False)
    i2, c2, _ = K.speculate(qp2, KP2, n + pad, keep2, caps2, 0.125, 8.0, 133, False)
    assert torch.equal(c1[0], c2[0])
    for g in range(G):
        assert i1[0, g, : c1[0, g]].tolist() == (i2[0, g, : c2[0, g]] - pad).tolist()


def test_kernels_give_the_same_bits_with_any_thread_count(tiny_models):
    """the decode thread count changes with the machine's load (threads.py), so a result must not
    depend on it: the same logits to the bit with 1, 2 and 3 threads (speculate, partial_query, attend and
    linear all split their work across the team)."""
    if kernels.library() is None:
        pytest.skip("no C++ compiler: the kernels are not built")
    model = tiny_models["llama-gqa"]
    ids, mask = left_padded_batch(lengths=(60, 45, 31))
    before = torch.get_num_threads()
    out = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            cache = ig.make_cache("infinigen", model, budget=0.3, min_budget=0)
            out.append(step_logits(model, cache, ids, mask, steps=4))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(o, out[0]) for o in out[1:])


def test_the_thread_tuner_leaves_other_processes_their_cores(monkeypatch):
    """Every interval the tuner reads how many cores other processes kept busy (the CPUs' busy time minus this
    process's own) and runs on the rest, at least one, at most the count it started with; --threads fixes it."""
    from infinigen_kv.runtime import threads

    counts = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: counts.append(n))
    monkeypatch.setattr(torch, "get_num_threads", lambda: counts[-1] if counts else 4)

    class FakeLoad:  # a 4-core machine shared fairly between our busy threads and `others` busy ones
        cores, t, busy, own, others = 4, 0.0, 0.0, 0.0, 0.0

        def now(self):
            return self.t

        def sample(self):
            return self.t, self.busy, self.own

        def advance(self, seconds):
            ours = torch.get_num_threads()
            self.t += seconds
            self.own += seconds * ours * min(1.0, self.cores / (ours + self.others))
            self.busy += seconds * min(self.cores, ours + self.others)

    load = FakeLoad()
    t = threads.Tuner(load=load, interval=0.5)
    tuned = backend.reference()  # a CPU backend without a fixed count: its steps follow the load

    def run(seconds, others):
        load.others = others
        for _ in range(int(seconds / 0.05)):
            load.advance(0.05)
            t.step(tuned)

    t.watch(tuned)  # the first look before the prefill
    run(1.0, 0.0)
    assert torch.get_num_threads() == 4 and counts == []  # idle: all cores, nothing touched
    run(2.0, 2.0)  # a competitor on two cores: we see it take more of them as we leave it more
    assert torch.get_num_threads() == 2 and t.others == pytest.approx(2.0)
    run(1.0, 7.0)  # more busy threads than cores: one thread, not zero
    assert torch.get_num_threads() == 1
    run(1.0, 0.3)  # it left (a little background noise stays): back to every core, never above the start
    assert torch.get_num_threads() == 4
    n = len(counts)
    t.interval = 10.0
    run(2.0, 3.0)  # under an interval: no look yet
    assert len(counts) == n
    t.step(backend.build("cuda"))  # not a CPU step: nothing to tune
    assert len(counts) == n
    fixed = backend.reference(threads=2)  # --threads 2: fixed, whatever the load
    t.interval = 0.5
    for others in (0.0, 3.0, 0.0):
        load.others = others
        for _ in range(20):
            load.advance(0.05)
            t.step(fixed)
    assert counts[-1] == 2 and torch.get_num_threads() == 2


def test_a_prefill_starts_on_the_cores_left(monkeypatch):
    """Before a prefill the tuner chooses its count from a first look at the machine (taken there, the process idle,
    when no recent one exists); with a recent look it chooses at once, with no wait."""
    from infinigen_kv.runtime import threads

    counts = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: counts.append(n))
    monkeypatch.setattr(torch, "get_num_threads", lambda: counts[-1] if counts else 4)

    class IdleLoad:  # 4 cores; `others` busy ones; this process idle while it looks
        cores, t, busy, own, others = 4, 0.0, 0.0, 0.0, 3.0

        def now(self):
            return self.t

        def sample(self):
            return self.t, self.busy, self.own

    load = IdleLoad()
    slept = []

    def sleep(seconds):
        slept.append(seconds)
        load.t += seconds
        load.busy += seconds * load.others

    monkeypatch.setattr(threads.time, "sleep", sleep)
    t = threads.Tuner(load=load, interval=0.5)
    tuned = backend.reference()
    t.before_prefill(tuned)
    assert slept == [threads.FIRST_LOOK] and counts == [1]  # three of four cores busy: one thread from the start
    load.others = 0.0
    load.t += 0.6  # a later prefill, 0.6 s after that look: chosen from it, no wait
    t.before_prefill(tuned)
    assert slept == [threads.FIRST_LOOK] and counts == [1, 4]


def test_the_machine_load_is_read_from_proc_stat():
    """On Linux the sample is real: wall time, busy seconds of this process's CPUs and our own CPU seconds all
    grow, and a busy loop of ours shows up as our own time, not as another process's."""
    from infinigen_kv.runtime import threads

    load = threads.Load()
    first = load.sample()
    if first is None:
        pytest.skip("no /proc/stat")
    cpu = time.process_time() + 0.3  # 0.3 s of our own CPU time, however busy the machine is
    while time.process_time() < cpu:
        pass
    second = load.sample()
    wall, busy, own = (b - a for a, b in zip(first, second))
    # (wall may be under 0.3 s: the CPU time counts every thread of the process, idle OpenMP workers spinning too)
    assert wall > 0 and own >= 0.25 and busy >= 0.25 and load.cores >= 1  # (clock ticks: 10 ms steps)


def test_rms_norm_kernel_gives_pytorchs_values():
    """A Llama-style RMSNorm of float32 rows on CPU is one `rms_norm` kernel call, close to the PyTorch ops, each row
    the same bits alone or among others; Gemma's (1 + w) norm runs the PyTorch ops."""
    from infinigen_kv.model import ops

    w = torch.randn(64)
    x = torch.randn(5, 1, 64)
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    b = backend.build("cpu")
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6, b), w * h, rtol=1e-5, atol=1e-5)
    assert torch.equal(ops.rms_norm(x, w, 1e-6, b)[2:3], ops.rms_norm(x[2:3], w, 1e-6, b))
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6, b, plus_one=True), h * (1 + w), rtol=1e-5, atol=1e-5)


def test_the_install_built_the_kernels():
    """The install (`make install`, or `infinigen build-kernels` after a pip install) compiles the CPU kernels for
    this machine: they are there before the suite's first command, so no user's first command waits for them; the
    command says so in one line, and again at once when they are built."""
    import shutil
    import subprocess
    import sys

    from conftest import KERNELS_BUILT_AT_START

    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler (or the kernels switched off): the PyTorch path serves")
    assert KERNELS_BUILT_AT_START, "the kernels were not built by the install: run `infinigen build-kernels`"
    r = subprocess.run([sys.executable, "-m", "infinigen_kv.cli", "build-kernels"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("infinigen: CPU kernels already built for this machine"), r
    r = subprocess.run([sys.executable, "-m", "infinigen_kv.cli", "build-kernels", "--json"], capture_output=True,
                       text=True, timeout=120)
    assert json.loads(r.stdout)["kernels"] == "already built"
