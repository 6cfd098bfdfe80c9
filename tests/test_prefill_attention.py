"""A prompt chunk's attention over a long past in bfloat16 products (kernels/prefill.cpp): the values of float64
attention of the same bfloat16 inputs, within the rounding of its bfloat16 probabilities, and the same rows as
PyTorch's attention where a left-padded batch goes row by row (model/attention._prefill_by_row)."""

import types

import pytest
import torch

from infinigen_kv.model import attention, kernels

K = kernels.library()
pytestmark = pytest.mark.skipif(K is None or not K.bf16_dots_native(),
                                reason="no CPU kernels with AVX-512 BF16 here (PyTorch's attention serves)")


def reference(q, k, v, scale):
    """float64 causal attention of q (T, H, d) over k, v (G, S, d), the last T keys the queries' own; q rounded to
    bfloat16 as the kernel reads it. -> (T, H, d)"""
    T, H, d = q.shape
    G, S, _ = k.shape
    q = q.bfloat16().double().transpose(0, 1)  # (H, T, d)
    k, v = (t.double().repeat_interleave(H // G, dim=0) for t in (k, v))
    s = q @ k.transpose(1, 2) * scale  # (H, T, S)
    s = s.masked_fill(torch.arange(S)[None] > torch.arange(T)[:, None] + S - T, float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G,r,d", [(2, 3, 64), (1, 4, 128)])
@pytest.mark.parametrize("T,S", [(5, 40), (37, 300), (70, 1100)])
def test_chunk_over_past_matches_float64(T, S, G, r, d, dtype):
    """Tiles and key blocks cut anywhere: T not a multiple of the 32-position tiles, S not of the 32-key blocks."""
    torch.manual_seed(T + S + d)
    q = torch.randn(T, G * r, d)
    k, v = (torch.randn(G, S, d).to(dtype) for _ in range(2))
    got = K.prefill_attend(q, k, v, d**-0.5)
    want = reference(q, k, v, d**-0.5)
    assert got.shape == (T, G * r, d) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=1e-2)  # bfloat16 probabilities: ~2^-9 each


def test_query_rows_may_be_strided():
    """The model passes a row's chunk as a (T, H, d) view of (1, H, T, d)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 20, 64), torch.randn(2, 100, 64), torch.randn(2, 100, 64)
    assert torch.equal(K.prefill_attend(q[0].transpose(0, 1), k, v, 0.125),
                       K.prefill_attend(q[0].transpose(0, 1).contiguous(), k, v, 0.125))


def test_a_left_padded_batch_over_a_long_past_row_by_row(monkeypatch):
    """Each row of a left-padded chunk attends its own keys in the kernel once its past is long enough: the rows of
    PyTorch's attention under the model's mask, within bfloat16 rounding, padding positions zero."""
    torch.manual_seed(1)
    B, G, r, d, past, T = 2, 2, 2, 64, 90, 24
    S = past + T
    q, k, v = torch.randn(B, G * r, T, d), torch.randn(B, G, S, d), torch.randn(B, G, S, d)
    mask = (torch.arange(S)[None] <= torch.arange(T)[:, None] + past)[None, None].repeat(B, 1, 1, 1)
    mask[1, ..., :30] = False  # the second row left-padded
    monkeypatch.setattr(attention, "LONG_PAST", 10**9)
    want = attention._prefill_by_row(q, k, v, mask, d**-0.5, None, None)
    calls = []
    monkeypatch.setattr(attention, "LONG_PAST", 32)
    real = K.prefill_attend
    ops = type("Ops", (), {"prefill_attend": staticmethod(lambda *a: calls.append(a[1].shape) or real(*a))})()
    got = attention._prefill_by_row(q, k, v, mask, d**-0.5, None, types.SimpleNamespace(bf16_attention=True, ops=ops))
    assert calls == [(G, S, d), (G, S - 30, d)]  # both rows: the second over its keys after the padding
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


def test_bfloat16_rows_are_read_as_stored(monkeypatch):
    """A chunk over a long past of bfloat16 K/V rows (the CPU default) reaches the kernel as those rows, no float32
    copy of the whole past (a 32k prefill's peak memory), with the outputs of their float32 copies, bit for bit."""
    torch.manual_seed(2)
    B, G, r, d, past, T = 1, 2, 3, 64, 70, 16
    S = past + T
    q = torch.randn(B, G * r, T, d)
    k, v = (torch.randn(B, G, S, d).bfloat16() for _ in range(2))
    mask = (torch.arange(S)[None] <= torch.arange(T)[:, None] + past)[None, None]
    monkeypatch.setattr(attention, "LONG_PAST", 32)
    seen = []
    real = K.prefill_attend
    ops = type("Ops", (), {"prefill_attend": staticmethod(lambda *a: seen.append(a[1].dtype) or real(*a))})()
    kernel = types.SimpleNamespace(bf16_attention=True, ops=ops)  # a backend whose prefill_attend is watched
    got, _ = attention.attend(q, attention.KVView(k, v), mask, d**-0.5, kernel)
    want, _ = attention.attend(q, attention.KVView(k.float(), v.float()), mask, d**-0.5, kernel)
    assert seen == [torch.bfloat16, torch.float32]
    assert torch.equal(got, want)
