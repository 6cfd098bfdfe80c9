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


@pytest.mark.parametrize("method", ["full", "infinigen"])
def test_decode_steps_attend_through_the_kernel(kernel, method, monkeypatch):
    """The GPU's attention path on CPU (the reference backend, the kernel in the interpreter): eager and static
    steps (what a graph replays) give the tokens of PyTorch's attention, a left-padded batch."""
    import infinigen_kv as ig
    from conftest import left_padded_batch, on_fake_cuda, tiny_model
    from infinigen_kv.model import attention, kernels, static

    monkeypatch.setattr(kernels, "_enabled", False)
    model = tiny_model("llama-gqa")
    ids, mask = left_padded_batch(lengths=(40, 27))
    opts = {"budget": 0.3, "min_budget": 0} if method == "infinigen" else {}

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
    monkeypatch.setattr(static, "graphs_on", lambda device, flag=None: flag is not False)  # static steps
    assert torch.equal(run(), ref)
    assert len(calls) == 2 * 3 * model.config.num_hidden_layers
