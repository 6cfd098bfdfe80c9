"""What the server may allocate: the RAM available to new allocations, and giving freed heap pages back."""

from __future__ import annotations

import os

from .. import heap


def available_memory() -> int:
    """Bytes of RAM available to new allocations (MemAvailable: free + reclaimable cache)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def release_memory() -> None:
    """Return the heap's free pages to the OS (after a batch's cache moved or shrank): what a prefill chunk or a
    rebatch frees in pieces below malloc's mmap threshold (activations, masks, per-row state) stays resident until
    then (KV buffers are mappings of their own: methods/rows.host_mapped). Without the trims after joins and
    retires, the admission burst grew RSS by 1.06x the pool limit, 1.03x with them (one run each)."""
    heap.trim()
