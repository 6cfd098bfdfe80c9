"""A decode query's attention over bfloat16 K/V rows in float32 products (cpu.cpp's attend; kernels/attend512.h where
the CPU has AVX-512; set here for every head count where the machine would take bfloat16 pairs for a few): the query as
it is times the stored values, against float64 attention of the same values, over the whole past and over chosen rows,
every head grouping (heads in fours, one or two heads without the widened scratch), block tail and head size."""

import pytest
import torch

from infinigen_kv.model import kernels

K = kernels.cpu()
pytestmark = pytest.mark.skipif(K is None, reason="no CPU kernels here")


@pytest.fixture(autouse=True)
def widened():
    before = K.attend_pairs_upto()
    K.set_attend_pairs_upto(0)
    yield
    K.set_attend_pairs_upto(before)


def reference(q, k, v, rows, scale):
    """q (r, d) over the rows `rows` of k, v (cap, d), in float64."""
    k, v = k[rows].double(), v[rows].double()
    return torch.softmax(q.double() @ k.T * scale, -1) @ v


@pytest.mark.parametrize("r", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n", [40, 1500, 3001])  # one short block, blocks of 64 cut at 16, an odd tail
def test_whole_past(n, d, r):
    torch.manual_seed(n + d + r)
    B, G, cap = 1, 2, n + 40
    q = torch.randn(B, G, r, d)
    Kp, Vp = (torch.randn(B, G, cap, d).bfloat16() for _ in range(2))
    keep = torch.rand(B, 1, n) > 0.1
    out = K.attend(q, Kp, Vp, None, None, None, -1, keep, n, d**-0.5, torch.float32)
    for g in range(G):
        rows = keep[0, 0].nonzero()[:, 0]
        torch.testing.assert_close(out[0, g].double(), reference(q[0, g], Kp[0, g], Vp[0, g], rows, d**-0.5),
                                   atol=1e-5, rtol=1e-5)


def test_chosen_rows_and_the_new_token():
    torch.manual_seed(0)
    B, G, r, d, cap, m = 2, 2, 7, 64, 5000, 1300
    q = torch.randn(B, G, r, d)
    Kp, Vp = (torch.randn(B, G, cap, d).bfloat16() for _ in range(2))
    idx = torch.randint(0, 4000, (B, G, m))
    count = torch.tensor([[m, 1200], [63, 20]])
    new = torch.randint(4000, cap, (B, G))
    out = K.attend(q, Kp, Vp, idx, count, new, -1, None, 0, 0.125, torch.float32)
    for b in range(B):
        for g in range(G):
            rows = torch.cat([new[b, g : g + 1], idx[b, g, : count[b, g]]])
            torch.testing.assert_close(out[b, g].double(), reference(q[b, g], Kp[b, g], Vp[b, g], rows, 0.125),
                                       atol=1e-5, rtol=1e-5)


def test_a_row_is_computed_alike_alone_or_beside_a_longer_one():
    """A row's result follows its own tokens (their chunks across threads), not its batch-mates'."""
    torch.manual_seed(1)
    G, r, d, cap = 1, 3, 64, 3000
    q = torch.randn(2, G, r, d)
    Kp, Vp = (torch.randn(2, G, cap, d).bfloat16() for _ in range(2))
    idx = torch.randint(0, cap, (2, G, 2000))
    count = torch.tensor([[2000], [40]])
    both = K.attend(q, Kp, Vp, idx, count, None, -1, None, 0, 0.125, torch.float32)
    alone = K.attend(q[1:], Kp[1:], Vp[1:], idx[1:], count[1:], None, -1, None, 0, 0.125, torch.float32)
    assert torch.equal(both[1], alone[0])
