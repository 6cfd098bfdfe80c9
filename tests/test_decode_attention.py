"""The GPU's decode attention (model/decode_attention.py): the Triton kernels a GPU runs, run here by Triton's
interpreter, against PyTorch's SDPA; a static step's whole capacity under its mask gives the bits of the eager
step's n keys."""

import importlib
import sys

import pytest
import torch

from infinigen_kv.model import decode_attention as da


@pytest.fixture
def kernel(monkeypatch):
    """The kernels on a GPU; here, in Triton's interpreter (TRITON_INTERPRET=1 from conftest, set before triton is
    imported: its own library functions are interpreted only then)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        from infinigen_kv.model.decode_attention_triton import triton_decode_attention

        def on_gpu(*args):
            return triton_decode_attention(*(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)).cpu()

        yield on_gpu
        return
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when the kernels are decorated: a fresh import
    sys.modules.pop("infinigen_kv.model.decode_attention_triton", None)
    yield importlib.import_module("infinigen_kv.model.decode_attention_triton").triton_decode_attention
    sys.modules.pop("infinigen_kv.model.decode_attention_triton", None)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("shape", [(2, 2, 4, 64, 300), (1, 3, 1, 40, 70)])  # B, G, r, d, m (GQA; MHA, d not 2^k)
def test_the_kernel_attends_as_sdpa(kernel, dtype, tol, shape):
    B, G, r, d, m = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, G, n, d, generator=g).to(dtype) for n in (r, m, m))
    some = torch.rand(B, 1, 1, m, generator=g) > 0.3
    for mask in (None, some, some.expand(B, G, 1, m), torch.rand(B, G, 1, m, generator=g) > 0.5):
        got = kernel(q, k, v, mask, d**-0.5)
        assert got.dtype == dtype and got.shape == (B, G, r, d)
        ref = da.reference(q.float(), k.float(), v.float(), mask, d**-0.5)
        assert (got.float() - ref).abs().max() < tol


def rounded(x: torch.Tensor, dtype) -> torch.Tensor:
    """float32 x rounded to dtype as the kernel does, back in float32: to nearest on a GPU; Triton's interpreter
    truncates to bfloat16."""
    if dtype == torch.bfloat16 and not torch.cuda.is_available():
        return (x.view(torch.int32) & ~0xFFFF).view(torch.float32)
    return x.to(dtype).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_reads_int8_rows_as_the_reference_dequantizes_them(kernel, dtype):
    """int8 K/V rows (values, then a scale per 32) read where they lie: as attending over from_rows' values in the
    query's dtype; d = 80 ends in a short group."""
    from infinigen_kv.model.int8_rows import pack_kv
    from infinigen_kv.model.kv import from_rows

    B, G, r, d, m = 2, 2, 3, 80, 300
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, G, r, d, generator=g).to(dtype)
    k, v = (pack_kv(torch.randn(B, G, m, d, generator=g) * 3) for _ in range(2))
    mask = torch.rand(B, G, 1, m, generator=g) > 0.3
    got = kernel(q, k, v, mask, d**-0.5)
    ref = da.reference(q.float(), *(rounded(from_rows(x, torch.float32), dtype) for x in (k, v)), mask, d**-0.5)
    assert got.dtype == dtype and got.shape == (B, G, r, d)
    assert ((got.float() - ref).abs() <= (1e-5 if dtype == torch.float32 else 8e-3) * (1 + ref.abs())).all()
    assert (got.float() - da.reference(q, k[..., :d].to(dtype), v[..., :d].to(dtype), mask, d**-0.5).float()
            ).abs().max() > 0.1  # the scales are applied


@pytest.mark.parametrize("dtype,n,capacity", [(torch.float32, 517, 1300), (torch.bfloat16, 517, 1300),
                                              (torch.float32, 300, 4700)])  # (spans in one chunk; in two)
def test_a_static_capacity_gives_the_eager_bits(kernel, dtype, n, capacity):
    """Keys past n (never written: NaN here) and left padding masked out: the same bits as the n keys alone."""
    B, G, r, d = 2, 2, 4, 64
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, G, x, d, generator=g).to(dtype) for x in (r, capacity, capacity))
    k[:, :, n:], v[:, :, n:] = float("nan"), float("nan")
    pad = torch.ones(B, 1, 1, capacity, dtype=torch.bool)
    pad[1, ..., :50] = False
    valid = pad.clone()
    valid[..., n:] = False
    eager = kernel(q, k[:, :, :n], v[:, :, :n], pad[..., :n], 0.125)
    static = kernel(q, k, v, valid, 0.125)
    assert torch.equal(eager, static) and not static.isnan().any()


def test_a_query_with_nothing_to_attend_gets_zeros(kernel):
    q, k, v = (torch.randn(1, 1, n, 16) for n in (2, 5, 5))
    out = kernel(q, k, v, torch.zeros(1, 1, 1, 5, dtype=torch.bool), 0.25)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("method,kv_dtype", [("full", "auto"), ("infinigen", "auto"), ("infinigen", "int8")])
def test_decode_steps_attend_through_the_kernel(kernel, method, kv_dtype, monkeypatch):
    """The GPU's attention path on CPU (the reference backend, the kernel in the interpreter): eager and static
    steps (what a graph replays) give the tokens of PyTorch's attention, a left-padded batch; int8 rows read where
    they lie give the tokens of attending over their dequantized values."""
    import infinigen_kv as ig
    from conftest import left_padded_batch, on_fake_cuda, tiny_model
    from infinigen_kv.model import attention, backend, static
    from infinigen_kv.model.int8_rows import kv_width

    model = tiny_model("llama-gqa")
    monkeypatch.setattr(model, "backend", backend.reference())  # the reference backend: what a GPU runs
    ids, mask = left_padded_batch(lengths=(40, 27))
    opts = ({"budget": 0.3, "min_budget": 0} if method == "infinigen" else {}) | {"kv_dtype": kv_dtype}

    def run():
        cache = ig.make_cache(method, model, **opts)
        if method == "infinigen":
            on_fake_cuda(cache)
        return ig.generate(model, ids, mask, cache=cache, max_new_tokens=4, stop_at_eos=False).tokens

    ref = run()
    calls = []
    monkeypatch.setattr(attention, "split_decode", lambda q: True)
    monkeypatch.setattr(attention, "decode_attention", lambda *a: calls.append(a[1].shape) or kernel(*a))
    assert torch.equal(run(), ref)
    monkeypatch.setattr(static, "graphs_on", lambda model, device, flag=None: flag is not False)  # static steps
    assert torch.equal(run(), ref)
    assert len(calls) == 2 * 3 * model.config.n_layers
    d = model.config.head_dim
    assert {shape[-1] for shape in calls} == {kv_width(d) if kv_dtype == "int8" else d}  # rows as stored
