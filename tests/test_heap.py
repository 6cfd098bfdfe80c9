"""heap.mapped(): what a load or a prefill frees goes back to the OS at once (glibc; elsewhere nothing to test)."""

import pytest
import torch

from infinigen_kv import heap

pytestmark = pytest.mark.skipif(heap._LIBC is None, reason="glibc's malloc only")


def rss_anon_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


def freed_but_resident(n: int = 64) -> tuple[float, float]:
    """MB grown by n tensors of 4 MiB and MB still resident once all but the last are freed (the survivor, allocated
    last, sits at the heap's top: what lies below it can only go back to the OS if it was mapped on its own)."""
    before = rss_anon_mb()
    blocks = [torch.ones(1 << 20) for _ in range(n)]
    grown = rss_anon_mb() - before
    survivor = blocks[-1:]
    del blocks
    kept = rss_anon_mb() - before
    del survivor
    return grown, kept


def test_what_a_mapped_block_frees_leaves_the_process():
    with heap.mapped():
        grown, kept = freed_but_resident()
    assert grown > 200 and kept < 16, (grown, kept)
    grown, kept = freed_but_resident()  # after a block: 4 MiB from the heap (as after glibc's threshold rose)
    assert grown > 200 and kept > 200, (grown, kept)  # freed, still resident


def test_nested_blocks_restore_the_threshold_once():
    with heap.mapped():
        with heap.mapped():
            assert heap._depth == 2
        assert heap._depth == 1
    assert heap._depth == 0
