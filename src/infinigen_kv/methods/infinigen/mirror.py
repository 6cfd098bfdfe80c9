"""A prompt prefilled in chunks on a GPU: the past each chunk of a pooled layer attends. From the layer's device
mirror, made at its second chunk from the pool and appended to by the next ones (each chunk reading the whole past
back from the pool would move O(n^2 / chunk) bytes over the bus), where the device has room for it; else read back
from the pool for each chunk. The mirror is dropped when decoding starts (the first decode write, or before a
graph's capture)."""

from __future__ import annotations

import torch

from ..rows import RowBuffer
from .staging import rows_to

# Device bytes the mirrors of a prompt leave free: a chunk's activations (B x 2,048 x the MLP's width), the logits, the
# decode steps' working sets.
HEADROOM = 6 << 30


def fits(device: torch.device, nbytes: int) -> bool:
    """Whether a mirror of `nbytes` leaves HEADROOM of `device` free (what PyTorch holds unused counts as free).
    Mirrors are made layer by layer until they would not: a long prompt's whole K/V would otherwise sit on the device
    through its prefill, the memory the pool exists to spare (B4 x 128k on Llama-3.1-8B's shape: 64 GiB). CPU
    stand-ins: always."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return nbytes + HEADROOM <= free


def past(layer, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The pooled `layer`'s K, V (B, G, n, w) on `device`, its staged rows already in the pool: its mirror (made now
    where none is and it fits), or a copy read back."""
    bufs = (layer.k, layer.v)
    if layer.mirror is None:
        rows = max(layer.k.length, layer.reserved)  # the prompt's rows (cache.reserve): made once, never grown
        if not fits(device, rows * sum(b.batch * b.heads * b.width * b.dtype.itemsize for b in bufs)):
            return tuple(read_back(buf, device) for buf in bufs)
        try:
            layer.mirror = tuple(RowBuffer(b.batch, b.heads, b.width, b.dtype, device) for b in bufs)
            for mirror in layer.mirror:
                mirror.reserve(rows, room=not layer.reserved)
        except torch.cuda.OutOfMemoryError:
            layer.mirror = None
            return tuple(read_back(buf, device) for buf in bufs)
        for mirror, buf in zip(layer.mirror, bufs):
            rows_to(buf, buf.length, mirror.data[:, :, : buf.length])
            mirror.length = buf.length
    return layer.mirror[0].valid(), layer.mirror[1].valid()


def read_back(buf, device: torch.device) -> torch.Tensor:
    """A pool buffer's valid rows on `device`, copied (async, per (sequence, head)) into a fresh tensor."""
    out = torch.empty(buf.batch, buf.heads, buf.length, buf.width, dtype=buf.dtype, device=device)
    rows_to(buf, buf.length, out)
    return out
