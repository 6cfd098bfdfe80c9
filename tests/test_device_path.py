"""The CUDA transfer path (CudaTransfer, pinned pool, side stream, events) run on CPU with stand-ins for torch.cuda
(infinigen_kv.testing.FakeCuda): the same code in the same order, the copies done at once, in both of its modes
(`uva`: the side stream gathers through a device view of the pool; `worker`: a thread gathers on the host). What a
GPU run would show of its results, host syncs, allocations and bytes moved, checked here on every commit
(tests/test_cuda.py runs the real thing on a GPU)."""

import threading

import pytest
import torch

import infinigen_kv as ig
from conftest import left_padded_batch, on_fake_cuda, tiny_model
from infinigen_kv.methods.infinigen.layer import partial_dtype
from infinigen_kv.model import backend


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama-gqa")


@pytest.fixture
def device_path(model, monkeypatch):
    """No CPU kernels: the PyTorch code a GPU runs (scores, select, partial query rows, attention): the reference
    backend, for the module's model and (returned) for a test's own."""
    monkeypatch.setattr(model, "backend", backend.reference())
    return backend.reference()


MODES = [True, False]  # uva, worker
MODE_IDS = ["uva", "worker"]


def run(model, ids, mask, method="infinigen", fake=True, new=8, uva=True, **options):
    cache = ig.make_cache(method, model, **options)
    transfer = on_fake_cuda(cache, uva) if fake else None
    out = ig.generate(model, ids, mask, cache=cache, max_new_tokens=new, stop_at_eos=False)
    return out.tokens, cache, transfer


@pytest.mark.parametrize("uva", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2", "opt"])
def test_device_path_is_exact_at_full_budget(device_path, kind, uva):
    model = tiny_model(kind, backend=device_path)
    ids, mask = left_padded_batch(lengths=(90, 70, 51))
    ref, _, _ = run(model, ids, mask, "full", fake=False)
    got, cache, transfer = run(model, ids, mask, alpha=1e9, budget=1.0, uva=uva)
    assert torch.equal(got, ref)
    assert transfer.bytes_moved > 0 and cache.stats["bytes_moved"] == transfer.bytes_moved
    got, _, _ = run(model, ids, mask, "offload", uva=uva)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("uva", MODES, ids=MODE_IDS)
def test_device_path_selects_as_the_direct_path(device_path, uva):
    """Budget 0.3 of the past, alpha small enough that rows differ in their counts: the tokens are those of the
    CPU (direct) path with the same selection; the worker trims each fetch to its largest real count (the uva
    gather fetches every slot of the cap: the counts stay on the device, as the mask)."""
    model = tiny_model("llama-gqa", backend=device_path)
    with torch.no_grad():  # peaked attention (a random init's is flat: every token within any alpha)
        for layer in model.layers:
            layer.attn.q_proj.weight.mul_(8)
            layer.attn.k_proj.weight.mul_(8)
    ids, mask = left_padded_batch(lengths=(160, 120))
    for alpha in (1.0, 12.0):
        opts = dict(alpha=alpha, budget=0.3, min_budget=0)
        ref, _, _ = run(model, ids, mask, fake=False, **opts)
        got, cache, transfer = run(model, ids, mask, uva=uva, **opts)
        assert torch.equal(got, ref)
        kv = cache.layers[1].k.data.element_size()  # the pool's storage (kv_dtype)
        rows = cache.counters.rows_moved * 2 * 16 * kv  # every slot of every fetch, K and V, d = 16
        if alpha == 1.0 and not uva:  # few tokens within alpha: the trimmed fetches move less than the cap's slots
            assert 0 < transfer.bytes_moved < rows
        else:
            assert transfer.bytes_moved == rows


@pytest.mark.parametrize("uva", MODES, ids=MODE_IDS)
def test_int8_rows_cross_as_int8(device_path, model, uva):
    """kv_dtype="int8": a prompt's rows quantized on the device before they are staged, the chosen rows crossing as
    int8 rows (d values and their float16 scale: 18 bytes a row of d = 16 against bfloat16's 32) and read in the model's
    dtype on the device: the full cache's tokens at the same storage, at full budget and for offload."""
    ids, mask = left_padded_batch(lengths=(90, 70, 51))
    ref, _, _ = run(model, ids, mask, "full", fake=False, kv_dtype="int8")
    moved = {}
    for kv in ("int8", "bfloat16"):
        got, cache, transfer = run(model, ids, mask, alpha=1e9, budget=1.0, uva=uva, kv_dtype=kv)
        assert cache.layers[1].k.dtype == getattr(torch, kv)
        moved[kv] = transfer.bytes_moved
        if kv == "int8":
            assert torch.equal(got, ref)
            got, _, _ = run(model, ids, mask, "offload", uva=uva, kv_dtype=kv)
            assert torch.equal(got, ref)
    assert moved["int8"] * 32 == moved["bfloat16"] * 18


def where() -> str:
    """file:line of the innermost caller outside torch."""
    import traceback

    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename:
            return f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno}"
    return "?"


SYNCS = ("tolist", "item", "__bool__", "__int__", "__float__", "cpu", "numpy")


@pytest.mark.parametrize("uva", MODES, ids=MODE_IDS)
def test_decode_loop_has_no_host_sync_on_the_device_path(device_path, model, monkeypatch, uva):
    """Every call that reads a device tensor's value on the host (a host sync on a GPU), made on the main thread
    during the decode steps, is counted: none. (select used to size each fetch with a .tolist() of the
    counts: one sync per speculated layer and step, draining the compute stream before every prefetch.)"""
    calls = []
    counting = threading.Event()
    for name in SYNCS:
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, _name=name, **k):
            if counting.is_set() and threading.current_thread() is threading.main_thread():
                calls.append(f"{_name} at {where()}")
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)

    def on_step(i, ids, lp):  # the decode steps only: from the first token to the last (the setup may sync)
        counting.set() if i < 5 else counting.clear()

    for lengths in ((150,), (150, 110)):  # unpadded (no mask at all) and left-padded
        ids, mask = left_padded_batch(lengths=lengths)
        cache = ig.make_cache("infinigen", model, budget=0.3, min_budget=0)
        on_fake_cuda(cache, uva)
        counting.clear()
        ig.generate(model, ids, mask, cache=cache, max_new_tokens=6, stop_at_eos=False, on_step=on_step)
        counting.clear()
        assert cache.stats["fetched_fraction"] < 0.5  # the speculated path ran
        if len(lengths) == 1:
            assert calls == [], calls
        calls.clear()


@pytest.mark.parametrize("uva", MODES, ids=MODE_IDS)
def test_no_allocation_inside_decode(device_path, model, uva):
    """Staging slots, decode-row staging and events are made with the prefill (sized by cache.reserve), none
    inside the decode steps: the buffers stay the same, and no Event is made after step 0."""
    ids, mask = left_padded_batch(lengths=(150, 110))
    cache = ig.make_cache("infinigen", model, budget=0.3, min_budget=0)
    transfer = on_fake_cuda(cache, uva)
    seen = {}

    def buffers():
        ring = [b.data_ptr() for s in transfer.ring.host + transfer.ring.dev for b in s.bufs.values()]
        return ring + [b.data_ptr() for s in transfer.rows.values() for b in s.bufs.values()]

    def on_step(i, ids, lp):
        if i == 0:
            seen["buffers"], seen["events"] = buffers(), len(transfer.cuda.events)

    ig.generate(model, ids, mask, cache=cache, max_new_tokens=40, stop_at_eos=False, on_step=on_step)
    assert buffers() == seen["buffers"] and len(transfer.cuda.events) == seen["events"]


@pytest.mark.parametrize("uva", MODES, ids=MODE_IDS)
def test_offload_copies_rows_as_they_lie(device_path, model, monkeypatch, uva):
    """Offload on the device path: no index tensor goes to the host and nothing is gathered by index or through
    staging; the pool's rows are copied as they lie (the worker: one copy per (sequence, head), rows_to; uva:
    one copy from the pool's view)."""
    from infinigen_kv.methods import rows as pool
    from infinigen_kv.methods.infinigen import cuda_transfer as transfer_mod

    ids, mask = left_padded_batch(lengths=(70, 50))
    ref, _, _ = run(model, ids, mask, "full", fake=False, new=5)
    cache = ig.make_cache("offload", model)
    transfer = on_fake_cuda(cache, uva)
    moved = []
    rows_to = transfer_mod.rows_to
    monkeypatch.setattr(transfer_mod, "rows_to", lambda buf, n, out: (moved.append(n), rows_to(buf, n, out)))

    def no_gather(self, idx, out=None):
        raise AssertionError("offload gathered rows by index")

    monkeypatch.setattr(pool.RowBuffer, "gather", no_gather)
    got = ig.generate(model, ids, mask, cache=cache, max_new_tokens=5, stop_at_eos=False).tokens
    assert torch.equal(got, ref)
    assert bool(moved) != uva and transfer.bytes_moved > 0
    assert not any(s.bufs for s in transfer.ring.host)  # no index, no staging


@pytest.mark.parametrize("uva", MODES, ids=MODE_IDS)
def test_chunked_prefill_reads_the_past_from_a_device_mirror(device_path, model, monkeypatch, uva):
    """A prompt in chunks (the server's prefill): each chunk attends over the whole past. The pool is read back
    once per layer (at the second chunk), not once per chunk, and decoding after it matches a one-shot prefill."""
    from infinigen_kv.methods.infinigen import mirror as mirror_mod

    ids = torch.randint(3, 256, (1, 200), generator=torch.Generator().manual_seed(3))
    read = []
    rows_to = mirror_mod.rows_to
    monkeypatch.setattr(mirror_mod, "rows_to", lambda buf, n, out: (read.append(n), rows_to(buf, n, out)))
    cache, full = ig.make_cache("infinigen", model, budget=0.3, min_budget=0), ig.make_cache("full", model)
    on_fake_cuda(cache, uva)
    with torch.inference_mode():
        for s in range(0, 200, 50):  # four chunks
            got = model(input_ids=ids[:, s : s + 50], past_key_values=cache, use_cache=True).logits
            ref = model(input_ids=ids[:, s : s + 50], past_key_values=full, use_cache=True).logits
            torch.testing.assert_close(got, ref)  # each chunk attended over the whole past
    pooled = sum(not layer.dense for layer in cache.layers)
    assert read == [100] * 2 * pooled  # K and V of each pooled layer, at the second chunk, once (not 100, 150)
    assert all(layer.mirror[0].length == 200 for layer in cache.layers if not layer.dense)
    out = ig.generate(model, ids, cache=cache, max_new_tokens=4, stop_at_eos=False, prefilled=got[:, -1])
    assert out.tokens.shape == (1, 4) and all(layer.mirror is None for layer in cache.layers)
    assert cache.stats["fetched_fraction"] < 0.5  # decoded through the pool, the mirror dropped


def test_static_steps_drop_the_prompt_mirrors(device_path, model, monkeypatch):
    """Static steps (one CUDA graph a step) after a prompt in chunks: the device mirrors of its past go before the
    capture (the step reads the pool), so the decode holds on the device what an eager one holds."""
    from infinigen_kv.model import static

    monkeypatch.setattr(static, "graphs_on", lambda model, device, flag=None: flag is not False)  # no graph on CPU: the steps
    ids = torch.randint(3, 256, (1, 200), generator=torch.Generator().manual_seed(3))
    cache = ig.make_cache("infinigen", model, budget=0.3, min_budget=0)
    on_fake_cuda(cache)
    with torch.inference_mode():
        for s in range(0, 200, 50):
            got = model(input_ids=ids[:, s : s + 50], past_key_values=cache, use_cache=True).logits
    assert all(layer.mirror is not None for layer in cache.layers if not layer.dense)
    calls = []
    monkeypatch.setattr(static.StaticDecoder, "step", lambda self, ids, f=static.StaticDecoder.step: (
        calls.append(1), f(self, ids))[1])
    out = ig.generate(model, ids, cache=cache, max_new_tokens=4, stop_at_eos=False, prefilled=got[:, -1])
    assert calls and out.tokens.shape == (1, 4)
    assert all(layer.mirror is None for layer in cache.layers)


@pytest.mark.parametrize("why", ["over the headroom", "allocation failed"])
def test_chunked_prefill_without_room_for_a_mirror(device_path, model, monkeypatch, why):
    """No device memory for the prompt's mirror (it would leave less than the headroom free, or its allocation
    fails): each chunk reads the past back from the pool instead (more bytes moved, same attention)."""
    from infinigen_kv.methods.infinigen import mirror as mirror_mod

    def no_room(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("no room")

    if why == "over the headroom":
        monkeypatch.setattr(mirror_mod, "fits", lambda device, nbytes: False)

    ids = torch.randint(3, 256, (1, 150), generator=torch.Generator().manual_seed(3))
    cache, full = ig.make_cache("infinigen", model, budget=0.3, min_budget=0), ig.make_cache("full", model)
    on_fake_cuda(cache)
    with torch.inference_mode():
        for s in range(0, 150, 50):
            ref = model(input_ids=ids[:, s : s + 50], past_key_values=full, use_cache=True).logits
            if s == 50 and why == "allocation failed":
                monkeypatch.setattr(mirror_mod, "RowBuffer", no_room)
            got = model(input_ids=ids[:, s : s + 50], past_key_values=cache, use_cache=True).logits
            torch.testing.assert_close(got, ref)
    assert all(layer.mirror is None for layer in cache.layers)


def test_partial_query_from_only_the_rows_it_needs(device_path, model):
    """The PyTorch partial query of a RoPE model with raw channels (a GPU's) computes only the q_proj rows of
    the partial channels and their rotate-half partners (2p a head), and equals the whole query's channels."""
    cache = ig.make_cache("infinigen", model, budget=0.3)
    a = cache.arch
    x = torch.randn(3, 1, a.hidden_size)
    pos = torch.tensor([[5], [17], [40]])
    step = model.step_inputs(pos, None, 40)
    for layer in range(1, a.num_layers):
        W = cache.pq.rows_on(layer, "cpu")[0]
        assert W.shape[0] == a.num_heads * 2 * cache.pq.channels[layer].shape[-1]  # P and their partners
        rope = step.rope(layer)
        got = cache.partial_query(layer, x, rope, step.memo)
        q = a.query(layer, x, rope, model.backend).view(3, a.num_kv_heads, a.group, a.head_dim)
        ref = q.gather(-1, cache.pq.channels[layer].view(1, a.num_kv_heads, 1, -1).expand(3, -1, a.group, -1))
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_scores_are_float32_on_every_device(model):
    """The approximate scores are float32 whatever the partial keys' storage (bf16 logits step 0.125-0.25 at 20-40
    and tie the top-k); on a GPU "auto" stores the partial keys in bfloat16 (widened as read), "float32" and "model"
    as named."""
    from infinigen_kv.methods.infinigen.speculator import approx_scores

    q, k = torch.randn(1, 2, 2, 8, dtype=torch.bfloat16), torch.randn(1, 2, 30, 8, dtype=torch.bfloat16)
    s = approx_scores(q, k, 0.5)
    assert s.dtype == torch.float32
    torch.testing.assert_close(s, q.float() @ k.float().transpose(-1, -2) * 0.5)
    cache = ig.make_cache("infinigen", model, budget=0.3)
    gpu = backend.build("cuda")
    assert partial_dtype(cache.config.partial_dtype, torch.bfloat16, torch.device("cuda"), gpu) == torch.bfloat16
    assert partial_dtype(cache.config.partial_dtype, torch.float32, torch.device("cuda"), gpu) == torch.bfloat16
    assert partial_dtype("float32", torch.bfloat16, torch.device("cuda"), gpu) == torch.float32
    assert partial_dtype("model", torch.float16, torch.device("cuda"), gpu) == torch.float16
