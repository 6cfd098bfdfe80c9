"""The decode step as a CUDA graph needs it, checked on CPU through the PyTorch path a GPU runs (infinigen_kv/testing/steptrace.py):
no host read inside a step, on every method that fetches; the trace itself sees host reads, views and buffers."""

import pytest
import torch

import infinigen_kv as ig
from conftest import left_padded_batch
from infinigen_kv.model import backend
from infinigen_kv.runtime.generation import prefill
from infinigen_kv.testing.steptrace import StepTrace, first_difference


def test_the_trace_sees_host_reads_views_and_buffers():
    x = torch.arange(6.0)
    with StepTrace() as a:
        y = x.view(2, 3).sum()
        y.item()
        x.tolist()
    with StepTrace() as b:
        x.view(2, 3).sum()
    assert a.host_reads == ["aten::_local_scalar_dense", "Tensor.tolist"] and not b.host_reads
    assert torch.Tensor.tolist is not None and x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # restored
    assert a.kernels == 2 and b.kernels == 1  # sum, then the read; the view launches nothing
    with StepTrace() as c:
        x.view(2, 3).sum()
    assert first_difference(b, c) is None  # the same ops on the same buffer
    with StepTrace() as d:
        x.clone().view(2, 3).sum()
    assert first_difference(b, d) is not None


@pytest.mark.parametrize("method", ["full", "offload", "infinigen"])
def test_a_decode_step_reads_nothing_back(tiny_models, method, monkeypatch):
    """A host read (`.item()`, `.tolist()`, `bool(t)`) inside a step is a sync on a GPU, and a step that has one
    cannot be captured: none in a left-padded batch's decode steps."""
    model = tiny_models["llama-gqa"]
    monkeypatch.setattr(model, "backend", backend.reference())  # the reference backend: what a GPU runs
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    cache = ig.make_cache(method, model, **({"budget": 0.2, "min_budget": 0} if method == "infinigen" else {}))
    tok = prefill(model, ids, mask, cache, 4).argmax(-1)
    positions = mask.long().sum(-1, keepdim=True)  # (B, 1): each row's next position
    for i in range(3):
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        with StepTrace() as t:
            tok = model.decode(cache, tok, positions + i, mask).argmax(-1)
        assert t.host_reads == [], (method, i)
        assert t.kernels > 0


def test_kernels_per_layer_on_the_gpu_path(tiny_models, monkeypatch):
    """The ops a decode step's layer runs on the GPU path (CudaTransfer on CPU stand-ins, the reference backend),
    counted: a speculated layer's extra over the full cache's layer stays at most what it is today (a ceiling that
    only comes down: each op is a launch on a GPU, where the eager step is bound by launches)."""
    from conftest import on_fake_cuda

    model = tiny_models["llama-gqa"]
    monkeypatch.setattr(model, "backend", backend.reference())  # the reference backend: what a GPU runs
    ids = torch.randint(3, 200, (1, 300), generator=torch.Generator().manual_seed(0))
    per_layer = {}
    for method in ("full", "offload", "infinigen"):
        cache = ig.make_cache(method, model, **({"budget": 0.1, "min_budget": 0} if method == "infinigen" else {}))
        if method != "full":
            on_fake_cuda(cache)
        tok = prefill(model, ids, None, cache, 4).argmax(-1)
        for i in range(3):
            t = StepTrace()
            before = cache.before_attention
            monkeypatch.setattr(cache, "before_attention", lambda *a, t=t, before=before: (t.mark(), before(*a))[1])
            with t:
                tok = model.decode(cache, tok, torch.full((1, 1), 300 + i), None).argmax(-1)
            monkeypatch.delattr(cache, "before_attention")
        assert t.host_reads == []
        per_layer[method] = t.marks[3][1] - t.marks[2][1]  # layer 2: speculated, and speculating layer 3
    assert per_layer["infinigen"] - per_layer["full"] <= 21, per_layer  # (a static step: 12, test_static.py)
    assert per_layer["offload"] - per_layer["full"] <= 5, per_layer
