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

    def append(self, x: torch.Tensor) -> None:
        """Append rows x (B, G, T, width) after the valid ones."""
        T = x.shape[2]
        self.reserve(self.length + T)
        self.data[:, :, self.length : self.length + T].copy_(x)
        self.length += T

    def valid(self) -> torch.Tensor:
        """View of the valid rows: (B, G, length, width)."""
        return self.data[:, :, : self.length]

    def row_base(self, device=None) -> torch.Tensor:
        """(B, G, 1) int64: where each (sequence, head)'s rows start in the flattened buffer."""
        device = torch.device(device) if device is not None else self.device
        key = (self.capacity, device)
        if getattr(self, "_base_key", None) != key:
            self._base = torch.arange(self.batch * self.heads, device=device).view(self.batch, self.heads, 1)
            self._base = self._base * self.capacity
            self._base_key = key
        return self._base

    def gather_flat(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows at flat indices rows (B, G, m) (position + row_base()): (B, G, m, width).

        One index_select over the flattened buffer: reads exactly the selected rows and can write straight
        into a staging buffer `out`.
        """
        B, G, m = rows.shape
        flat = self.data.view(-1, self.width)
        if out is None:
            return flat.index_select(0, rows.view(-1)).view(B, G, m, self.width)
        torch.index_select(flat, 0, rows.view(-1), out=out.view(B * G * m, self.width))
        return out

    def gather(self, idx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows at positions idx (B, G, m) of each (sequence, head): (B, G, m, width)."""
        return self.gather_flat(idx + self.row_base(idx.device), out)

    def reset(self) -> None:
        self.length = 0
