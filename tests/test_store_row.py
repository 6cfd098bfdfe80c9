"""A static step's row store (methods/infinigen/store_row.py): the Triton kernel a GPU runs, run here by Triton's
interpreter, writes what the PyTorch reference writes; the op is one op of a step's trace."""

import importlib
import sys

import pytest
import torch

from infinigen_kv.methods.infinigen import store_row as sr


def buffers(dtype, partial: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, G, cap, d, p, m = 2, 3, 10, 12, 5, 4
    k, v = (torch.randn(B, G, 1, d, generator=g).to(dtype) for _ in range(2))
    pools = [torch.zeros(B + 1, G, cap, d, dtype=dtype)[:B] for _ in range(2)]  # a store with a spare sequence
    ws = [torch.zeros(B, G, 1 + m, d, dtype=dtype) for _ in range(2)]
    part = torch.zeros(B, G, cap, p) if partial else None
    channels = torch.randint(0, d, (G, p), generator=g) if partial else None
    return k, v, *pools, torch.tensor([7]), *ws, part, channels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partial", [True, False])
def test_the_triton_kernel_stores_what_the_reference_stores(dtype, partial, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when the kernel is decorated: a fresh import below
    sys.modules.pop("infinigen_kv.methods.infinigen.store_row_triton", None)
    kernel = importlib.import_module("infinigen_kv.methods.infinigen.store_row_triton")
    try:
        expect, got = buffers(dtype, partial), buffers(dtype, partial)
        sr.reference(*expect)
        kernel.triton_store(*got)
        for e, g in zip(expect, got):
            if isinstance(e, torch.Tensor):
                assert torch.equal(e, g)
        assert expect[2][:, :, 7].abs().sum() > 0  # (written at the column)
    finally:
        sys.modules.pop("infinigen_kv.methods.infinigen.store_row_triton", None)


def test_the_op_is_one_op_of_a_step():
    from infinigen_kv.testing.steptrace import StepTrace

    expect, got = buffers(torch.float32, True), buffers(torch.float32, True)
    sr.reference(*expect)
    with StepTrace() as t:
        sr.store_row(*got)
    assert t.kernel_names == ["infinigen::store_row"]
    assert all(torch.equal(e, g) for e, g in zip(expect, got) if isinstance(e, torch.Tensor))


def test_a_triton_kernel_that_fails_here_falls_back_once():
    """A kernel that cannot run (here: a name its module lacks) warns once and gives the reference's result from
    then on; one that runs gives its own."""
    import warnings

    from infinigen_kv.model.triton_kernel import TritonKernel

    broken = TritonKernel("model.triton_kernel:no_such_kernel", "test kernel")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert broken(lambda x: x + 1, 1) == 2 and broken(lambda x: x + 1, 2) == 3
    assert not broken.ok and len(caught) == 1 and "test kernel" in str(caught[0].message)
    works = TritonKernel("methods.infinigen.store_row:reference", "row store")
    expect, got = buffers(torch.float32, True), buffers(torch.float32, True)
    sr.reference(*expect)
    works(lambda *a: None, *got)  # the target itself ran (the fallback writes nothing)
    assert works.ok and all(torch.equal(e, g) for e, g in zip(expect, got) if isinstance(e, torch.Tensor))
