"""RowBuffer: chunked growth keeps contents; gather returns the right rows."""

import pytest
import torch

import infinigen_kv as ig
from infinigen_kv.methods.rows import CHUNK, RowBuffer


def test_growth_keeps_contents_and_is_chunked():
    buf = RowBuffer(2, 3, 4, torch.float32, "cpu")
    ref = []
    for step in range(5):
        x = torch.randn(2, 3, 700 if step == 0 else 1, 4)
        buf.append(x)
        ref.append(x)
    ref = torch.cat(ref, dim=2)
    assert buf.length == 704
    assert buf.capacity % CHUNK == 0 and buf.capacity >= 704
    torch.testing.assert_close(buf.valid(), ref)
    cap = buf.capacity
    for _ in range(10):
        buf.append(torch.randn(2, 3, 1, 4))
    assert buf.capacity == cap  # no reallocation per step
    big = torch.randn(2, 3, 3000, 4)
    buf.append(big)
    torch.testing.assert_close(buf.valid()[:, :, :704], ref)
    torch.testing.assert_close(buf.valid()[:, :, -3000:], big)


def test_gather_returns_selected_rows_per_sequence_and_head():
    buf = RowBuffer(2, 3, 4, torch.float32, "cpu")
    data = torch.randn(2, 3, 50, 4)
    buf.append(data)
    idx = torch.randint(0, 50, (2, 3, 7))
    expect = torch.gather(data, 2, idx.unsqueeze(-1).expand(-1, -1, -1, 4))
    torch.testing.assert_close(buf.gather(idx), expect)
    out = torch.empty(2, 3, 7, 4)
    assert buf.gather(idx, out=out) is out
    torch.testing.assert_close(out, expect)


def test_reset_empties():
    buf = RowBuffer(1, 1, 2, torch.float32, "cpu")
    buf.append(torch.ones(1, 1, 5, 2))
    buf.reset()
    assert buf.length == 0 and buf.valid().shape == (1, 1, 0, 2)


def test_worker_writes_inference_tensors():
    """The CUDA prefetch worker writes into pool tensors made under inference mode in the caller's thread
    (ig.generate): it must run under inference mode too. The mechanism, reproduced on CPU with a thread."""
    from concurrent.futures import ThreadPoolExecutor

    from infinigen_kv.methods.infinigen.cuda_transfer import submit_inference

    with torch.inference_mode():
        pool = torch.zeros(4, 8)
    with ThreadPoolExecutor(max_workers=1) as worker:
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
            worker.submit(pool[1].copy_, torch.ones(8)).result()  # what the worker did before
        submit_inference(worker, pool[1].copy_, torch.ones(8)).result()
    assert pool[1].sum() == 8


def test_prefill_leaves_room_for_decode():
    """A prompt sized exactly to a chunk multiple must not make decode step 1 copy the whole buffer."""
    buf = RowBuffer(2, 3, 4, torch.float32, "cpu")
    buf.append(torch.randn(2, 3, 4096, 4))
    data = buf.data
    for _ in range(CHUNK):
        buf.append(torch.randn(2, 3, 1, 4))
    assert buf.data is data  # no reallocation in the first CHUNK decode steps


def test_pinned_capacity_fills_the_power_of_two_block():
    from infinigen_kv.methods.rows import pinned_capacity

    row = 4 * 3 * 64 * 2  # B x G x d x bf16
    for rows in (1, 1000, 4096 + 64, 5000):
        cap = pinned_capacity(rows, row)
        block = 1 << (rows * row - 1).bit_length()
        assert rows <= cap and cap * row <= block < (cap + 1) * row
    assert pinned_capacity(5000, row, max_rows=5200) == 5200  # never past a byte limit


@pytest.mark.parametrize("method", ["infinigen", "full", "offload"])
def test_no_buffer_grows_inside_decode(tiny_models, method, monkeypatch):
    """ig.generate sizes every buffer for prompt + new tokens before the prefill: no pool is re-allocated (on
    a GPU: re-pinned, every layer at once) inside decode. Small chunks make the old growth show at step 9."""
    import infinigen_kv as ig
    from infinigen_kv.methods import rows as pool

    monkeypatch.setattr(pool, "CHUNK", 8)
    model = tiny_models["llama-gqa"]
    ids = torch.randint(3, 200, (2, 40))
    cache = ig.make_cache(method, model, budget=0.3, min_budget=0)
    seen = {}

    def buffers():
        return [b.data for l in cache.layers for b in (l.k, l.v, getattr(l, "partial", None)) if b is not None]

    def on_step(i, ids, _):
        if i == 0:  # after the prefill, before the first decode step
            seen["after_prefill"] = buffers()

    ig.generate(model, ids, cache=cache, max_new_tokens=30, stop_at_eos=False, on_step=on_step)
    assert all(a is b for a, b in zip(seen["after_prefill"], buffers()))
    assert all(b.shape[2] == 70 for b in buffers())  # exactly prompt + new tokens


def test_staging_ring_is_shared_in_turn_and_refuses_overrun():
    """The CUDA path's staging slots are used in turn by every layer; a slot is held from its prefetch to
    its layer's fetch, and more fetches in flight than slots is a bug that must not pass silently."""
    from infinigen_kv.testing import FakeCuda
    from infinigen_kv.methods.infinigen.cuda_transfer import StagingRing

    cuda = FakeCuda()
    ring = StagingRing("cpu", cuda, slots=3, pin=False)
    a, b = ring.acquire(), ring.acquire()  # layer 1 speculates itself and layer 2: two in flight
    ring.release(a, "compute")
    c, d = ring.acquire(), ring.acquire()
    assert (a, b, c, d) == (0, 1, 2, 0) and ring.consumed[a].stream == "compute"
    with pytest.raises(RuntimeError, match="overrun"):
        ring.acquire()  # slot 1 is still held by its fetch: never overwrite it
    ring.reset()  # a cache reused for a new prompt: nothing is in flight
    assert ring.acquire() == 0
    assert len(cuda.events) == 6  # two per slot, made once


def test_join_and_retain_copy_only_the_rows_that_move():
    """Continuous batching on host memory: a sequence joining a batch whose rows stay where they are is
    written into the store's spare rows, and one leaving has its place taken by the last row; the store
    (and every other row) stays put."""
    def buf(x):
        b = RowBuffer(1, 2, 4, torch.float32, "cpu")
        b.append(x)
        return b

    pad = lambda x, n: torch.nn.functional.pad(x, (0, 0, n - x.shape[2], 0))  # left padding to n columns
    xa, xb, xc = torch.randn(1, 2, 10, 4), torch.randn(1, 2, 6, 4), torch.randn(1, 2, 8, 4)
    a = buf(xa)
    a.join(buf(xb), 0, 4, room=3)  # a new store, with spare rows and columns
    store = a.store
    a.join(buf(xc), 0, 2, room=3)
    assert a.store is store and a.batch == 3 and a.length == 10
    torch.testing.assert_close(a.valid(), torch.cat([xa, pad(xb, 10), pad(xc, 10)]))
    a.retain([0, 2], 0, room=3)  # row 1 leaves: row 2 takes its place
    assert a.store is store and a.batch == 2
    torch.testing.assert_close(a.valid(), torch.cat([xa, pad(xc, 10)]))
    a.retain([1], trim=2, room=3)  # columns go: a new, narrower store
    assert a.store is not store and a.length == 8
    torch.testing.assert_close(a.valid(), xc)


def test_rows_that_leave_give_their_pages_back():
    """A large host buffer is an anonymous mapping: the rows of sequences that left are released (they read
    as zeros, and are not resident)."""
    b = RowBuffer(1, 1, 256, torch.float32, "cpu")  # 1 KiB per column: mapped
    b.append(torch.randn(1, 1, 1500, 256))
    other = RowBuffer(1, 1, 256, torch.float32, "cpu")
    other.append(torch.randn(1, 1, 1500, 256))
    b.join(other, 0, 0, room=1)
    assert b._map is not None and bool(b.store[1].abs().sum() > 0)
    b.retain([0])
    assert b.batch == 1 and b.nbytes == 1500 * 1024
    assert float(b.store[1].abs().sum()) == 0.0


def test_cost_model_counts_pinned_rounding():
    """A pinned pool's bytes per token are counted at the pinned allocator's worst rounding (a power of two):
    the server's admission must not let pinned memory outgrow RAM."""
    from conftest import tiny_model
    from infinigen_kv.methods.rows import PIN_ROUNDING

    model = tiny_model("llama-gqa")
    cache = ig.make_cache("infinigen", model, budget=0.3)
    ig.generate(model, torch.randint(3, 256, (1, 20)), cache=cache, max_new_tokens=2)
    layer = cache.layers[2]
    plain = layer.token_bytes()
    layer.k.pin = layer.v.pin = True  # as on a GPU (the partial keys stay on the device)
    partial = layer.partial.heads * layer.partial.width * layer.partial.data.element_size()
    assert layer.token_bytes() == PIN_ROUNDING * (plain - partial) + partial
