"""heap.mapped(): what a load or a prefill frees goes back to the OS at once (glibc; elsewhere nothing to test)."""

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
