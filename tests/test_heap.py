"""heap.py: what a model load frees goes back to the OS at once (mapped), and a prefill trims the heap after each
chunk (glibc; elsewhere nothing to test)."""

import pytest
import torch

from infinigen_kv import heap

pytestmark = pytest.mark.skipif(heap._LIBC is None, reason="glibc's malloc only")


def rss_anon_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


def test_what_a_mapped_block_frees_leaves_the_process():
    # by the block's end: inside it, large blocks are mappings of their own; free chunks the heap already had
    # (released pages in the middle of the heap, after an earlier trim) may serve them, and its end trims those
    heap._LIBC.mallopt(heap.M_MMAP_THRESHOLD, heap.HEAP_BELOW)  # as glibc after a large block was freed
    before = rss_anon_mb()
    with heap.mapped():
        blocks = [torch.ones(1 << 20) for _ in range(64)]  # 64 x 4 MiB
        grown = rss_anon_mb() - before
        survivor = blocks[-1:]  # allocated last: what lies below it in the heap can only go with a trim or an unmap
        del blocks
    kept = rss_anon_mb() - before
    del survivor
    assert grown > 200 and kept < 16, (grown, kept)


def test_nested_blocks_restore_the_threshold_once():
    with heap.mapped():
        with heap.mapped():
            assert heap._depth == 2
        assert heap._depth == 1
    assert heap._depth == 0


def test_a_load_runs_mapped(tmp_path, monkeypatch):
    from conftest import save_tiny
    from infinigen_kv.model import load

    depth = []
    real = load.load_files
    monkeypatch.setattr(load, "load_files", lambda *a: depth.append(heap._depth) or real(*a))
    load.load_model(save_tiny(tmp_path / "m"), device="cpu")
    assert depth == [1] and heap._depth == 0


def test_a_prefill_trims_the_heap_after_each_chunk(tiny_models, monkeypatch):
    from infinigen_kv.methods.registry import make_cache
    from infinigen_kv.runtime import generation

    model = tiny_models["llama-gqa"]
    trims = []
    monkeypatch.setattr(heap, "trim", lambda: trims.append(1))
    monkeypatch.setattr(generation, "PREFILL_CHUNK", 10)
    generation.prefill(model, torch.randint(3, 200, (1, 48)), cache=make_cache("full", model), max_new_tokens=2)
    assert len(trims) == 5  # 48 = 8 + 4 x 10
