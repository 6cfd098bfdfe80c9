"""The process heap (glibc's malloc): while a model loads, large allocations are mappings of their own, so that what
loading frees goes back to the OS at once instead of staying resident.

glibc serves an allocation from its heap below a threshold that starts at 128 KiB and rises to the size of each
mapped block freed, up to 32 MiB. Once a load has freed its first large block (a tensor dequantized, converted,
dropped), every tensor under that size comes from the heap, and what the load frees there stays resident.
`mapped()` holds the threshold at 256 KiB for its block; after it, at 32 MiB (where glibc's own threshold settles:
a decode step's temporaries are reused from the heap, and the heap's top is kept up to 64 MiB, as glibc keeps it)
and trims the heap. A prefill is not mapped (its activations, faulted in afresh at every op, made it 1.1-1.3x
slower): it trims the heap after each chunk, whose activations the next chunk (attending a longer past) would not
reuse in place. Elsewhere (another libc) it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MAPPED_FROM = 256 << 10  # bytes: allocations this large are mappings inside mapped()
HEAP_BELOW = 32 << 20  # and below this, from the heap, after it


def _libc():
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt, libc.malloc_trim  # glibc's; musl and others lack them
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()
_lock = threading.Lock()
_depth = 0  # mapped() blocks open (nested, or on several threads): the threshold is restored when the last ends


def trim() -> None:
    """Return the heap's free pages to the OS."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


@contextlib.contextmanager
def mapped():
    """Large allocations as their own mappings inside the block (see the module); then the heap trimmed."""
    global _depth
    if _LIBC is None:
        yield
        return
    with _lock:
        _depth += 1
        if _depth == 1:
            _LIBC.mallopt(M_MMAP_THRESHOLD, MAPPED_FROM)
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _LIBC.mallopt(M_MMAP_THRESHOLD, HEAP_BELOW)
                _LIBC.mallopt(M_TRIM_THRESHOLD, 2 * HEAP_BELOW)  # as glibc sets it beside its own threshold
                _LIBC.malloc_trim(0)
