"""bfloat16 dot products in the decode kernels (kernels/bf16_dots.h, where the CPU has AVX-512 BF16).

A decode query over K.BF16_ATTEND_ROWS (64) or more bfloat16 rows, where the machine takes bfloat16 pairs for its
heads a KV head (set here for every head count; kernels.attend_pairs_upto): float64 attention of the same values, the
query rounded to bfloat16, within the rounding of the bfloat16 probabilities; over the whole past and over chosen rows,
every head grouping and tail. A decode step's rows times a bfloat16 weight (linear with bf16=True): float64 products
of x rounded to bfloat16, every row the same bits alone or in a batch."""

import pytest
import torch

from infinigen_kv.model import kernels

K = kernels.cpu()
pytestmark = pytest.mark.skipif(K is None or not K.bf16_dots_native(),
                                reason="no CPU kernels with AVX-512 BF16 here (float32 products serve)")


@pytest.fixture
def pairs():
    """attend in bfloat16 pairs for any query heads a KV head, for the test."""
    before = K.attend_pairs_upto()
    K.set_attend_pairs_upto(64)
    yield
    K.set_attend_pairs_upto(before)


def reference(q, k, v, rows, scale):
    """q (r, d) rounded to bfloat16 over the rows `rows` of k, v (cap, d), in float64."""
    q = q.bfloat16().double()
    k, v = k[rows].double(), v[rows].double()
    return torch.softmax(q @ k.T * scale, -1) @ v


@pytest.mark.parametrize("r", [1, 2, 3, 5, 7])  # the value products take heads in fours: every remainder
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n", [64, 1500, 3001])  # blocks of 64 cut at 16, an odd tail
def test_whole_past(n, d, r, pairs):
    torch.manual_seed(n + d + r)
    B, G, cap = 1, 2, n + 40
    q = torch.randn(B, G, r, d)
    Kp, Vp = (torch.randn(B, G, cap, d).bfloat16() for _ in range(2))
    keep = torch.rand(B, 1, n) > 0.1
    out = K.attend(q, Kp, Vp, None, None, None, -1, keep, n, d**-0.5, torch.float32)
    for g in range(G):
        rows = keep[0, 0].nonzero()[:, 0]
        torch.testing.assert_close(out[0, g].double(), reference(q[0, g], Kp[0, g], Vp[0, g], rows, d**-0.5),
                                   atol=1e-2, rtol=1e-2)


def test_chosen_rows_and_the_new_token(pairs):
    torch.manual_seed(0)
    B, G, r, d, cap, m = 2, 2, 7, 64, 5000, 1300
    q = torch.randn(B, G, r, d)
    Kp, Vp = (torch.randn(B, G, cap, d).bfloat16() for _ in range(2))
    idx = torch.randint(0, 4000, (B, G, m))
    count = torch.tensor([[m, 1200], [63, 20]])  # the last two rows short (with the new token 64: bfloat16; 21 not)
    new = torch.randint(4000, cap, (B, G))
    out = K.attend(q, Kp, Vp, idx, count, new, -1, None, 0, 0.125, torch.float32)
    for b in range(B):
        for g in range(G):
            rows = torch.cat([new[b, g : g + 1], idx[b, g, : count[b, g]]])
            want = reference(q[b, g], Kp[b, g], Vp[b, g], rows, 0.125)
            tol = 1e-2 if rows.numel() >= K.BF16_ATTEND_ROWS else 1e-5
            if rows.numel() < K.BF16_ATTEND_ROWS:  # float32 products of the query as it is
                want = torch.softmax(q[b, g].double() @ Kp[b, g, rows].double().T * 0.125, -1) @ Vp[b, g, rows].double()
            torch.testing.assert_close(out[b, g].double(), want, atol=tol, rtol=tol)


def test_a_row_is_computed_alike_alone_or_beside_a_longer_one(pairs):
    """Whether a row runs in bfloat16 products follows its own length, not its batch-mates'."""
    torch.manual_seed(1)
    G, r, d, cap = 1, 3, 64, 3000
    q = torch.randn(2, G, r, d)
    Kp, Vp = (torch.randn(2, G, cap, d).bfloat16() for _ in range(2))
    idx = torch.randint(0, cap, (2, G, 2000))
    count = torch.tensor([[2000], [40]])
    both = K.attend(q, Kp, Vp, idx, count, None, -1, None, 0, 0.125, torch.float32)
    alone = K.attend(q[1:], Kp[1:], Vp[1:], idx[1:], count[1:], None, -1, None, 0, 0.125, torch.float32)
    assert torch.equal(both[1], alone[0])


@pytest.mark.parametrize("inputs", [896, 64 * 7 + 32 + 5])  # whole blocks of 64; a block of 32 and a masked tail
def test_a_linear_in_bfloat16_products(inputs):
    torch.manual_seed(inputs)
    W = torch.randn(150, inputs).bfloat16()
    x = torch.randn(7, inputs)
    y = K.linear(x, W, None, None, True)
    want = x.bfloat16().double() @ W.double().T
    torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4)  # float32 sums of exact products
    for b in range(7):  # blocks of 4, 2 and 1 rows: the same arithmetic per row
        assert torch.equal(K.linear(x[b : b + 1], W, None, None, True)[0], y[b])
    exact = K.linear(x, W, None, None, False)  # float32 products of x as it is
    assert not torch.equal(exact, y) and (exact - y).norm() / exact.norm() < 1e-2  # x's rounding: ~2^-9 a value
