"""The speculation's scores over 16-bit partial keys (methods/infinigen/partial_scores.py): the Triton kernel a GPU
runs, run here by Triton's interpreter, gives the reference's float32 logits; approx_scores takes that op for
bfloat16 keys and is one op of a step."""

import pytest
import torch

from conftest import triton_module

from infinigen_kv.methods.infinigen import partial_scores as ps
from infinigen_kv.methods.infinigen.speculator import approx_scores, keep_bias


def inputs(dtype, bias: bool, seed: int = 0, B: int = 2):
    g = torch.Generator().manual_seed(seed)
    G, r, p, cap, n = 3, 4, 40, 150, 137  # p not a power of two; n over two programs' keys, under capacity
    q = torch.randn(B, G, r, p, generator=g) * 3
    keys = (torch.randn(B + 1, G, cap, p, generator=g) * 2).to(dtype)[:B, :, :n]  # rows of a larger store
    keep = torch.rand(B, 1, n, generator=g) > 0.2
    return q, keys, keep_bias(keep, G) if bias else None


@pytest.mark.parametrize("B", [1, 2])  # B = 1: the step's mask is a view with a zero stride (keep_bias)
@pytest.mark.parametrize("bias", [False, True], ids=["no mask", "mask"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_triton_kernel_scores_what_the_reference_scores(dtype, bias, B, monkeypatch):
    """On a GPU the kernel itself; here in Triton's interpreter."""
    with triton_module("infinigen_kv.methods.infinigen.partial_scores_triton", monkeypatch) as (kernel, dev):
        q, keys, b = inputs(dtype, bias, B=B)
        expect = ps.reference(q, keys, b, 0.125)
        got = kernel.triton_scores(*(t.to(dev) if t is not None else None for t in (q, keys, b)), 0.125).cpu()
        assert got.dtype == torch.float32 and got.shape == expect.shape
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)  # float32 sums in another order
        if bias:
            assert torch.equal(torch.isinf(got), torch.isinf(expect))  # masked positions stay -inf


def test_bfloat16_keys_score_in_float32_as_one_op():
    """approx_scores over bfloat16 partial keys: the float32 logits of the widened keys (not bfloat16 logits, whose
    steps tie the top-k order), in one op of a step's trace."""
    from infinigen_kv.testing.steptrace import StepTrace

    q, keys, b = inputs(torch.bfloat16, True)
    with StepTrace() as t:
        got = approx_scores(q, keys, 0.125, b)
    assert t.kernel_names == ["infinigen::partial_scores"]
    torch.testing.assert_close(got, approx_scores(q, keys.float(), 0.125, b), rtol=0, atol=0)
    assert got.dtype == torch.float32
