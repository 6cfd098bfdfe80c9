"""Row buffers: per-(sequence, head) rows that grow in large chunks, and the gather of selected rows.

`RowBuffer` is the storage behind every cache here: the host KV pool of InfiniGen (pinned when a CUDA
device computes), its partial key cache, and the preallocated full cache. Rows [0, length) are valid;
the buffer grows geometrically in chunks, never per step, so appending a token is one small copy.
"""

from __future__ import annotations

import torch

CHUNK = 1024  # rows; growth is at least this and at least 50% of the current capacity


class RowBuffer:
    """A (B, G, capacity, width) tensor whose first `length` rows along dim 2 are valid."""

    def __init__(self, batch: int, heads: int, width: int, dtype, device, pin: bool = False):
        self.batch, self.heads, self.width = batch, heads, width
        self.dtype, self.device, self.pin = dtype, torch.device(device), pin
        self.length = 0
        self.data = self._alloc(0)

    def _alloc(self, capacity: int) -> torch.Tensor:
        shape = (self.batch, self.heads, capacity, self.width)
        return torch.empty(shape, dtype=self.dtype, device=self.device, pin_memory=self.pin)

    @property
    def capacity(self) -> int:
        return self.data.shape[2]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def reserve(self, rows: int) -> None:
        """Make room for `rows` rows in total, keeping the contents."""
        if rows <= self.capacity:
            return
        capacity = max(rows, self.capacity + max(CHUNK, self.capacity // 2))
        capacity = -(-capacity // CHUNK) * CHUNK
        data = self._alloc(capacity)
        data[:, :, : self.length].copy_(self.data[:, :, : self.length])
        self.data = data

    def append(self, x: torch.Tensor, non_blocking: bool = False) -> None:
        """Append rows x (B, G, T, width) after the valid ones."""
        T = x.shape[2]
        self.reserve(self.length + T)
        self.data[:, :, self.length : self.length + T].copy_(x, non_blocking=non_blocking)
        self.length += T

    def valid(self) -> torch.Tensor:
        """View of the valid rows: (B, G, length, width)."""
        return self.data[:, :, : self.length]

    def gather(self, idx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows at positions idx (B, G, m) of each (sequence, head): (B, G, m, width).

        One index_select over the flattened buffer: reads exactly the selected rows (no full-width gather
        index, no copy of anything else) and can write straight into a staging buffer `out`.
        """
        B, G, m = idx.shape
        cap = self.capacity
        base = torch.arange(B * G, device=idx.device, dtype=idx.dtype).view(B, G, 1) * cap
        flat = self.data.view(B * G * cap, self.width)
        rows = (idx + base).view(-1)
        if out is None:
            return flat.index_select(0, rows).view(B, G, m, self.width)
        torch.index_select(flat, 0, rows, out=out.view(B * G * m, self.width))
        return out

    def reset(self) -> None:
        self.length = 0
