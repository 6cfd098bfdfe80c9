"""A static step's row store (methods/infinigen/store_row.py): the Triton kernel a GPU runs, run here by Triton's
interpreter, writes what the PyTorch reference writes; the op is one op of a step's trace."""

import pytest
import torch

from conftest import triton_module
from infinigen_kv.methods.infinigen import store_row as sr
from infinigen_kv.model.int8_rows import kv_width, pack_kv


def buffers(dtype, partial: bool, seed: int = 0, rows=None, d: int = 12):
    """k, v in `dtype` and pools / working sets of `rows` (default: dtype; torch.int8: q8_0 rows, kv_width(d) bytes)."""
    g = torch.Generator().manual_seed(seed)
    B, G, cap, p, m = 2, 3, 10, 5, 4
    rows = rows or dtype
    w = kv_width(d) if rows == torch.int8 else d
    k, v = (torch.randn(B, G, 1, d, generator=g).to(dtype) for _ in range(2))
    k[0, 0, 0, : min(d, 32)] = 0  # a group of zeros: scale 0
    v[1, 2, 0, :3] = torch.tensor([1.0, -1.0, 0.5]) * 127 / 2  # values at halves of their group's step: ties
    pools = [torch.zeros(B + 1, G, cap, w, dtype=rows)[:B] for _ in range(2)]  # a store with a spare sequence
    ws = [torch.zeros(B, G, 1 + m, w, dtype=rows) for _ in range(2)]
    part = torch.zeros(B, G, cap, p) if partial else None
    channels = torch.randint(0, d, (G, p), generator=g) if partial else None
    return k, v, *pools, torch.tensor([7]), *ws, part, channels


@pytest.mark.parametrize("dtype,rows,d", [(torch.float32, None, 12), (torch.bfloat16, None, 12),
                                          (torch.float32, torch.int8, 12), (torch.bfloat16, torch.int8, 72),
                                          (torch.bfloat16, torch.int8, 128)])
@pytest.mark.parametrize("partial", [True, False])
def test_the_triton_kernel_stores_what_the_reference_stores(dtype, rows, d, partial, monkeypatch):
    """int8 rows: the kernel quantizes k, v in registers to the bytes model/int8_rows.py's pack_kv writes (d in
    groups of 32, the last one short at 12 and 72)."""
    with triton_module("infinigen_kv.methods.infinigen.store_row_triton", monkeypatch) as (kernel, dev):
        expect, got = buffers(dtype, partial, rows=rows, d=d), buffers(dtype, partial, rows=rows, d=d)
        sr.reference(*expect)
        kernel.triton_store(*(t.to(dev) if isinstance(t, torch.Tensor) else t for t in got))
        for e, g in zip(expect, got):
            if isinstance(e, torch.Tensor):
                assert torch.equal(e, g.cpu())
        assert expect[2][:, :, 7].abs().sum() > 0  # (written at the column)
        if rows == torch.int8:
            assert torch.equal(expect[2][:, :, 7:8], pack_kv(expect[0]))  # the reference is pack_kv's


def test_the_op_is_one_op_of_a_step():
    from infinigen_kv.testing.steptrace import StepTrace

    expect, got = buffers(torch.float32, True), buffers(torch.float32, True)
    sr.reference(*expect)
    with StepTrace() as t:
        sr.store_row(*got)
    assert t.kernel_names == ["infinigen::store_row"]
    assert all(torch.equal(e, g) for e, g in zip(expect, got) if isinstance(e, torch.Tensor))


def test_a_triton_kernel_runs_where_triton_is_and_a_failure_is_said():
    """Where Triton is installed the kernel runs (its own result), where it is not the reference; a kernel that
    cannot run here raises, naming itself, and the next call tries it again: no call's failure changes what later
    calls compute."""
    from infinigen_kv.model.triton_kernel import TritonError, TritonKernel

    broken = TritonKernel("model.triton_kernel:no_such_kernel", "test kernel", installed=True)
    for _ in range(2):
        with pytest.raises(TritonError, match="test kernel"):
            broken(lambda x: x + 1, 1)
    assert TritonKernel("model.triton_kernel:no_such_kernel", "test kernel", installed=False)(lambda x: x + 1, 1) == 2
    works = TritonKernel("methods.infinigen.store_row:reference", "row store", installed=True)
    expect, got = buffers(torch.float32, True), buffers(torch.float32, True)
    sr.reference(*expect)
    works(lambda *a: None, *got)  # the target itself ran (the reference given here writes nothing)
    assert all(torch.equal(e, g) for e, g in zip(expect, got) if isinstance(e, torch.Tensor))
