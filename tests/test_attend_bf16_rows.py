"""A decode query's attention over bfloat16 K/V rows (attend.cpp), in either of its products, each set here for
every head count: float32 products of the rows widened once for the query heads of a KV head (kernels/attend512.h
where the CPU has AVX-512; the query as it is) within 1e-5 of float64 attention of the same values; bfloat16 pairs
(kernels/bf16_dots.h, where the CPU has AVX-512 BF16) for K.BF16_ATTEND_ROWS (64) or more rows, the query rounded to
bfloat16, within the rounding of the bfloat16 probabilities (shorter rows: float32 products). Over the whole past and
over chosen rows, every head grouping (heads in fours; one or two heads without the widened scratch), block tail and
head size."""

import pytest
import torch

from infinigen_kv.model import kernels

K = kernels.library()
pytestmark = pytest.mark.skipif(K is None, reason="no CPU kernels here")


@pytest.fixture(params=["float32", "bfloat16"])
def products(request):
    """attend's products for any query heads a KV head, for the test: the name (`upto` gives its pairs_upto)."""
    if request.param == "bfloat16" and not K.bf16_dots_native():
        pytest.skip("no AVX-512 BF16 here")
    return request.param


def upto(products: str) -> int:
    """attend's pairs_upto for `products`: bfloat16 pairs at every head count, or never."""
    return 64 if products == "bfloat16" else 0


def check(out, q, k, v, rows, scale, products):
    """out (r, d) against float64 attention of q (r, d) over the rows `rows` of k, v (cap, d)."""
    pairs = products == "bfloat16" and rows.numel() >= K.BF16_ATTEND_ROWS
    q = (q.bfloat16() if pairs else q).double()
    want = torch.softmax(q @ k[rows].double().T * scale, -1) @ v[rows].double()
    tol = 1e-2 if pairs else 1e-5
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("r", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n", [40, 1500, 3001])  # one short block, blocks of 64 cut at 16, an odd tail
def test_whole_past(n, d, r, products):
    torch.manual_seed(n + d + r)
    B, G, cap = 1, 2, n + 40
    q = torch.randn(B, G, r, d)
    Kp, Vp = (torch.randn(B, G, cap, d).bfloat16() for _ in range(2))
    keep = torch.rand(B, 1, n) > 0.1
    out = K.attend(q, Kp, Vp, None, None, None, -1, keep, n, d**-0.5, torch.float32, upto(products))
    for g in range(G):
        check(out[0, g], q[0, g], Kp[0, g], Vp[0, g], keep[0, 0].nonzero()[:, 0], d**-0.5, products)


def test_chosen_rows_and_the_new_token(products):
    torch.manual_seed(0)
    B, G, r, d, cap, m = 2, 2, 7, 64, 5000, 1300
    q = torch.randn(B, G, r, d)
    Kp, Vp = (torch.randn(B, G, cap, d).bfloat16() for _ in range(2))
    idx = torch.randint(0, 4000, (B, G, m))
    count = torch.tensor([[m, 1200], [63, 20]])  # the last two rows short (with the new token 64: pairs; 21 not)
    new = torch.randint(4000, cap, (B, G))
    out = K.attend(q, Kp, Vp, idx, count, new, -1, None, 0, 0.125, torch.float32, upto(products))
    for b in range(B):
        for g in range(G):
            rows = torch.cat([new[b, g : g + 1], idx[b, g, : count[b, g]]])
            check(out[b, g], q[b, g], Kp[b, g], Vp[b, g], rows, 0.125, products)


def test_a_row_is_computed_alike_alone_or_beside_a_longer_one(products):
    """A row's result follows its own tokens (its products, its chunks across threads), not its batch-mates'."""
    torch.manual_seed(1)
    G, r, d, cap = 1, 3, 64, 3000
    q = torch.randn(2, G, r, d)
    Kp, Vp = (torch.randn(2, G, cap, d).bfloat16() for _ in range(2))
    idx = torch.randint(0, cap, (2, G, 2000))
    count = torch.tensor([[2000], [40]])
    both = K.attend(q, Kp, Vp, idx, count, None, -1, None, 0, 0.125, torch.float32, upto(products))
    alone = K.attend(q[1:], Kp[1:], Vp[1:], idx[1:], count[1:], None, -1, None, 0, 0.125, torch.float32,
                     upto(products))
    assert torch.equal(both[1], alone[0])


def test_the_products_are_the_kernel_paths_constant(monkeypatch, tmp_path):
    """The backend's attend_pairs_upto is its kernel path's constant (model/backend.py), the same at every build,
    whatever a measurement once kept beside the kernels' build says and whatever the machine's load: 0 where the CPU
    has no bfloat16 pairs, Intel's count on Intel's AVX-512 BF16, the path's elsewhere."""
    from infinigen_kv.model import backend

    b = backend.build("cpu")
    if not K.bf16_dots_native():
        assert b.attend_pairs_upto == 0
    elif kernels.cpu_vendor() == "GenuineIntel":
        assert b.attend_pairs_upto == backend.INTEL_PAIRS_UPTO
    else:
        assert b.attend_pairs_upto == backend.PATHS[b.path].attend_pairs_upto
    monkeypatch.setenv("INFINIGEN_ATTEND_PAIRS_UPTO", "5")  # a setting of the code before: read by nothing now
    assert backend.build("cpu") == b
    assert backend.build("cpu", attend_pairs_upto=3).attend_pairs_upto == (3 if K.bf16_dots_native() else 0)
