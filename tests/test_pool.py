"""RowBuffer: chunked growth keeps contents; gather returns the right rows."""

import pytest
import torch

from infinigen_kv.pool import CHUNK, RowBuffer


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

    from infinigen_kv.transfer import submit_inference

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
