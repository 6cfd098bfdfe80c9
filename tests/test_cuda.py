"""CUDA path: pinned host pool, side-stream prefetch with events, exactness on the GPU. Skipped without a GPU."""

import pytest
import torch

import infinigen_kv as ig
from conftest import left_padded_batch, tiny_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def gpu_model():
    return tiny_model("llama-gqa").to("cuda")


def test_pool_is_pinned_and_stream_path_used(gpu_model):
    from infinigen_kv.methods.infinigen.cuda_transfer import CudaTransfer

    ids, mask = left_padded_batch(lengths=(64, 50))
    cache = ig.make_cache("infinigen", gpu_model, budget=0.3, min_budget=0)
    ig.generate(gpu_model, ids.cuda(), mask.cuda(), cache=cache, max_new_tokens=4, stop_at_eos=False)
    assert isinstance(cache.transfer, CudaTransfer)
    dense, selective = cache.layers[0], cache.layers[2]
    assert dense.k.data.is_cuda  # layer 0 attends fully and stays on the device
    assert not selective.k.data.is_cuda and selective.k.data.is_pinned() and selective.v.data.is_pinned()
    assert selective.partial.data.is_cuda  # the partial key cache lives on the device
    assert cache.stats["bytes_moved"] > 0


@pytest.mark.parametrize("kind", ["llama-mha", "llama-gqa", "qwen2", "opt"])
def test_exact_on_gpu(kind):
    model = tiny_model(kind).to("cuda")
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    ref = model.generate(ids, past_key_values=ig.make_cache("full", model), **kw)
    got = model.generate(ids, past_key_values=ig.make_cache("infinigen", model, alpha=1e9, budget=1.0), **kw)
    assert torch.equal(got, ref)


def test_offload_exact_with_pinned_pool_on_gpu():
    model = tiny_model("llama-gqa").to("cuda")
    ids, mask = left_padded_batch(lengths=(48, 40, 31))
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    ref = model.generate(ids, past_key_values=ig.make_cache("full", model), **kw)
    cache = ig.make_cache("offload", model)
    assert torch.equal(model.generate(ids, past_key_values=cache, **kw), ref)
    assert all(not l.k.data.is_cuda and l.k.data.is_pinned() for l in cache.layers)  # every layer in the pool


def test_no_device_wide_synchronize_in_decode(gpu_model, monkeypatch):
    ids, mask = left_padded_batch(lengths=(64, 50))
    cache = ig.make_cache("infinigen", gpu_model, budget=0.2, min_budget=0)
    ids, mask = ids.cuda(), mask.cuda()
    with torch.inference_mode():
        gpu_model(input_ids=ids, attention_mask=mask, past_key_values=cache)  # prefill

        def forbidden(*a, **k):
            raise AssertionError("torch.cuda.synchronize() called in the decode loop")

        monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
        step_mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype, device="cuda")], 1)
        pos = mask.sum(-1, keepdim=True)
        out = gpu_model(input_ids=torch.tensor([[5], [6]], device="cuda"), attention_mask=step_mask,
                        position_ids=pos, past_key_values=cache)
    assert torch.isfinite(out.logits).all()


def test_transfer_owns_one_shared_staging_ring(gpu_model):
    """Staging is one ring of pinned/device slots per device, not buffers per layer; nothing is held after
    a run, and the pinned pools were sized once (no re-pinning inside decode)."""
    ids, mask = left_padded_batch(lengths=(64, 50))
    cache = ig.make_cache("infinigen", gpu_model, budget=0.3, min_budget=0)
    pools = {}

    def on_step(i, _, __):
        if i == 0:
            pools.update({l.layer_idx: l.k.data.data_ptr() for l in cache.layers})

    ig.generate(gpu_model, ids.cuda(), mask.cuda(), cache=cache, max_new_tokens=8, stop_at_eos=False,
                on_step=on_step)
    ring = cache.transfer.ring
    assert len(ring.busy) == 3 and not any(ring.busy)
    assert all(s.bufs["k"].is_pinned() for s in ring.host if "k" in s.bufs)
    assert not any(hasattr(l, "host_scratch") or hasattr(l, "unflushed") for l in cache.layers)
    assert pools == {l.layer_idx: l.k.data.data_ptr() for l in cache.layers}


def test_prompt_lands_in_the_pinned_pool(gpu_model):
    """A prompt's K/V reach the pinned pool through contiguous staging, landed by the worker: after a
    flush the pool holds what the full cache holds."""
    ids, mask = left_padded_batch(lengths=(64, 50))
    ids, mask = ids.cuda(), mask.cuda()
    full, cache = ig.make_cache("full", gpu_model), ig.make_cache("infinigen", gpu_model, budget=0.3, min_budget=0)
    with torch.inference_mode():
        gpu_model(input_ids=ids, attention_mask=mask, past_key_values=full)
        gpu_model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        for ref, layer in zip(full.layers[1:], cache.layers[1:]):
            layer.transfer.flush(layer)
            torch.testing.assert_close(layer.k.valid(), ref.k.valid().cpu())
            torch.testing.assert_close(layer.v.valid(), ref.v.valid().cpu())


def test_reset_mid_run_leaves_nothing_in_flight(gpu_model):
    ids, mask = left_padded_batch(lengths=(64, 50))
    ids, mask = ids.cuda(), mask.cuda()
    cache = ig.make_cache("infinigen", gpu_model, budget=0.3, min_budget=0)
    ref = ig.generate(gpu_model, ids, mask, cache=ig.make_cache("infinigen", gpu_model, budget=0.3, min_budget=0),
                      max_new_tokens=6, stop_at_eos=False).tokens
    ig.generate(gpu_model, ids, mask, cache=cache, max_new_tokens=3, stop_at_eos=False)
    cache.reset()
    assert torch.equal(ig.generate(gpu_model, ids, mask, cache=cache, max_new_tokens=6, stop_at_eos=False).tokens,
                       ref)


def test_a_fork_on_gpu_has_its_own_pinned_pool_and_stream(gpu_model):
    """Rebatch.fork on the CUDA path (the accuracy bench's per-budget decodes): a copy with its own pinned pool
    and transfer engine decodes as a cache prefilled alone, and leaves the original as it was."""
    from infinigen_kv.runtime.generation import generate, prefill
    from infinigen_kv.bench.tee import TeeCache

    ids = torch.randint(3, 256, (1, 120), generator=torch.Generator().manual_seed(0)).cuda()
    base, full = ig.make_cache("infinigen", gpu_model, budget=0.2, min_budget=0), ig.make_cache("full", gpu_model)
    logits = prefill(gpu_model, ids, None, TeeCache([base, full]), 8)
    for budget in (0.2, 16, 0.5):
        twin = base.fork(budget=budget)
        assert twin.transfer is not base.transfer and twin.layers[2].k.data.is_pinned()
        assert twin.layers[2].k.data.data_ptr() != base.layers[2].k.data.data_ptr()
        got = generate(gpu_model, ids, cache=twin, max_new_tokens=8, stop_at_eos=False, prefilled=logits).tokens
        ref = generate(gpu_model, ids, cache=ig.make_cache("infinigen", gpu_model, budget=budget, min_budget=0),
                       max_new_tokens=8, stop_at_eos=False).tokens
        assert torch.equal(got, ref)
    got = generate(gpu_model, ids, cache=full.fork(), max_new_tokens=8, stop_at_eos=False, prefilled=logits).tokens
    assert torch.equal(got, generate(gpu_model, ids, cache=ig.make_cache("full", gpu_model), max_new_tokens=8,
                                     stop_at_eos=False).tokens)


def test_pinned_pool_joins_in_place_and_is_counted_whole():
    """Continuous batching on a pinned pool: a join allocates spare sequences (half as many again), so the next
    join writes into them in place instead of re-pinning the batch; nbytes counts the whole pinned allocation
    (the server's pool figure) and the cost model counts pinned bytes at the allocator's worst rounding."""
    from infinigen_kv.methods.rows import PIN_ROUNDING, RowBuffer

    def buf(n):
        b = RowBuffer(1, 2, 64, torch.bfloat16, "cpu", pin=True)
        b.append(torch.randn(1, 2, n, 64).bfloat16())
        return b

    a = buf(100)
    a.join(buf(100), 0, 0)
    assert a.store.shape[0] == 3 and a.store.is_pinned() and a.batch == 2
    ptr = a.store.data_ptr()
    c = buf(80)
    a.join(c, 0, 20)
    assert a.store.data_ptr() == ptr and a.batch == 3  # in place: the spare sequence
    torch.testing.assert_close(a.valid()[2, :, 20:], c.valid()[0])
    assert a.nbytes == a.store.numel() * 2
    assert PIN_ROUNDING == 2


def test_the_row_store_runs_its_triton_kernel():
    """A static step's row store on the GPU: one Triton kernel (a failure would raise), the reference's bytes."""
    from infinigen_kv.model.triton_kernel import triton_installed

    assert triton_installed()
    from infinigen_kv.methods.infinigen import store_row as sr
    from test_store_row import buffers

    for dtype in (torch.float32, torch.bfloat16):
        expect = [t.cuda() if isinstance(t, torch.Tensor) else t for t in buffers(dtype, True)]
        got = [t.clone() if isinstance(t, torch.Tensor) else t for t in expect]
        sr.reference(*expect)
        sr.store_row(*got)
        assert all(torch.equal(e, g) for e, g in zip(expect, got) if isinstance(e, torch.Tensor))


@pytest.mark.parametrize("method", ["full", "offload", "infinigen"])
def test_a_running_batch_in_graphs(method, monkeypatch):
    """The server's running batch on the GPU: CUDA graphs over its bucket of rows (rows joining and leaving in place)
    give the tokens of eager steps (a backend built with cuda_graph=False)."""
    from infinigen_kv.testing import prompt, run_plan as run

    model = tiny_model("llama-gqa").to("cuda")
    plan = {"a": (0, prompt(40, 1), 16, None), "b": (0, prompt(30, 2), 16, None), "c": (0, prompt(20, 3), 6, None),
            "d": (4, prompt(10, 4), 8, None)}
    options = {"min_budget": 0} if method == "infinigen" else {}
    import dataclasses

    graphs = model.backend
    model.backend = dataclasses.replace(graphs, cuda_graph=False)
    eager = run(model, method, options, plan)
    model.backend = graphs
    assert run(model, method, options, plan) == eager
