"""bfloat16 dot products in the decode step's linears (kernels/bf16_dots.h, where the CPU has AVX-512 BF16): a decode
step's rows times a bfloat16 weight (linear with bf16=True) are float64 products of x rounded to bfloat16, every row
the same bits alone or in a batch. (Attention's bfloat16 pairs: tests/test_attend_bf16_rows.py.)"""

import pytest
import torch

from infinigen_kv.model import kernels

K = kernels.library()
pytestmark = pytest.mark.skipif(K is None or not K.bf16_dots_native(),
                                reason="no CPU kernels with AVX-512 BF16 here (float32 products serve)")


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
