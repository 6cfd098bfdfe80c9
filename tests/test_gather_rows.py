"""A static step's fetch (methods/infinigen/gather_rows.py): the Triton kernel a GPU runs, run here by Triton's
interpreter, copies the rows the PyTorch reference copies; the op is one op of a step's trace."""

import pytest
import torch

from conftest import triton_module
from infinigen_kv.methods.infinigen import gather_rows as gr


def buffers(dtype, seed: int = 0, d: int = 40):
    g = torch.Generator().manual_seed(seed)
    B, G, cap, m = 2, 3, 50, 21  # d not a power of two; m over one program's rows
    # a spare sequence; int8 rows (K/V in int8) are bytes: random values over their whole range
    pools = [(torch.randint(-128, 128, (B + 1, G, cap, d), generator=g, dtype=dtype) if dtype == torch.int8 else
              torch.randn(B + 1, G, cap, d, generator=g).to(dtype))[:B] for _ in range(2)]
    idx = torch.randint(0, cap, (B, G, m), generator=g)
    ws = [torch.full((B, G, 1 + m, d), 7, dtype=dtype) for _ in range(2)]
    return *pools, idx, *ws


@pytest.mark.parametrize("dtype,d", [(torch.float32, 40), (torch.bfloat16, 40), (torch.int8, 40), (torch.int8, 136),
                                     (torch.int8, 30)])
def test_the_triton_kernel_gathers_what_the_reference_gathers(dtype, d, monkeypatch):
    """On a GPU the kernel itself; here in Triton's interpreter. int8 rows of 40 and 136 bytes (q8_0 rows at
    d = 128) are copied as 8-byte words, of 30 bytes as bytes."""
    with triton_module("infinigen_kv.methods.infinigen.gather_rows_triton", monkeypatch) as (kernel, dev):
        expect, got = buffers(dtype, d=d), [t.to(dev) for t in buffers(dtype, d=d)]
        if dtype == torch.int8:
            assert (kernel.as_words(got[0]).dtype == torch.int64) == (d % 8 == 0)
        gr.reference(*expect)
        kernel.triton_gather(*got)
        got = [t.cpu() for t in got]
        assert torch.equal(expect[3], got[3]) and torch.equal(expect[4], got[4])
        assert (got[3][:, :, 0] == 7).all()  # slot 0 (the new row's) untouched


def test_the_op_is_one_op_of_a_step():
    from infinigen_kv.testing.steptrace import StepTrace

    expect, got = buffers(torch.float32), buffers(torch.float32)
    gr.reference(*expect)
    with StepTrace() as t:
        gr.gather_rows(*got)
    assert t.kernel_names == ["infinigen::gather_rows"]
    assert torch.equal(expect[3], got[3]) and torch.equal(expect[4], got[4])
