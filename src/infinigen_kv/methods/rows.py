"""Row buffers: per-(sequence, head) rows that grow in large chunks, and the gather of selected rows.

`RowBuffer` is the storage behind every cache here: the host KV pool of InfiniGen (pinned when a CUDA
device computes), its partial key cache, and the preallocated full cache. Rows [0, length) are valid;
the buffer grows geometrically in chunks, never per step, so appending a token is one small copy.
"""

from __future__ import annotations

import copy
import math
import mmap

import torch

from ..model.kv import to_rows

CHUNK = 1024  # rows; growth is at least this and at least 50% of the current capacity


def host_mapped(shape: tuple, dtype) -> tuple[torch.Tensor, mmap.mmap | None]:
    """An uninitialized host tensor in an anonymous private mapping of its own, and the mapping (None when
    empty). Its pages take memory only once written, release_pages gives them back, and all of it goes
    back to the OS when the tensor is freed: buffers of changing sizes allocated and freed through malloc
    (rows join and leave a server's batch all the time) fragment its heap, and the process keeps resident
    memory it no longer uses (measured: 3.8x a 400 MB pool limit; docs/BENCHMARKS.md)."""
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype), None
    m = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: see release_pages
    return torch.frombuffer(m, dtype=dtype, count=numel).view(shape), m


def release_pages(m: mmap.mmap | None, start: int, end: int) -> None:
    """Give the pages wholly inside bytes [start, end) of a private mapping back to the OS (they read as
    zeros after; a shared one would keep them)."""
    page = mmap.PAGESIZE
    start, end = -(-start // page) * page, end // page * page
    if m is not None and end > start and hasattr(m, "madvise"):
        m.madvise(mmap.MADV_DONTNEED, start, end - start)


PIN_ROUNDING = 2  # the most a pinned block exceeds what was asked for (PyTorch's power-of-two rounding)


def release_pinned() -> None:
    """Give the free blocks PyTorch's caching host allocator keeps back to the OS (after a batch shrank or a pool
    was freed: pinned blocks are otherwise kept for reuse, and pinned memory cannot be swapped)."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is not None and torch.cuda.is_available():
        empty()


def pinned_capacity(rows: int, row_bytes: int, max_rows: int | None = None) -> int:
    """Rows to allocate for at least `rows` in pinned memory: PyTorch's pinned (caching host) allocator
    rounds every block up to a power of two bytes, so take all of the block it will hand out."""
    capacity = (1 << (rows * row_bytes - 1).bit_length()) // row_bytes
    return min(capacity, max_rows) if max_rows is not None else capacity


class RowBuffer:
    """A (B, G, capacity, width) tensor whose first `length` rows along dim 2 are valid.

    `data` is the first B sequences of `store`, which may hold more: on host memory mapped lazily (not
    pinned) a buffer keeps spare sequences and columns, which cost nothing until written, so that a
    sequence joining a running batch is one copy of its own rows and one leaving is one copy of the last
    row into its place (continuous batching), not a copy of the whole batch."""

    def __init__(self, batch: int, heads: int, width: int, dtype, device, pin: bool = False,
                 max_rows: int | None = None):
        self.batch, self.heads, self.width = batch, heads, width
        self.dtype, self.device, self.pin = dtype, torch.device(device), pin
        self.max_rows = max_rows  # never allocate more rows than this (a byte-limited pool)
        self.length = 0
        self._set(*self._alloc(batch, 0))

    @property
    def spare(self) -> bool:
        """Whether this buffer allocates ahead (lazily mapped host memory: free until written)."""
        return self.device.type == "cpu" and not self.pin

    def _alloc(self, batch: int, capacity: int) -> tuple[torch.Tensor, mmap.mmap | None]:
        if self.pin and capacity:
            row = batch * self.heads * self.width * self.dtype.itemsize
            capacity = pinned_capacity(capacity, row, self.max_rows)
        shape = (batch, self.heads, capacity, self.width)
        if self.spare:  # its spare rows and columns cost nothing until written
            return host_mapped(shape, self.dtype)
        return torch.empty(shape, dtype=self.dtype, device=self.device, pin_memory=self.pin), None

    def _set(self, store: torch.Tensor, mapping: mmap.mmap | None, batch: int | None = None) -> None:
        """Make `store` the allocation and its first `batch` sequences the data."""
        self.store, self._map = store, mapping
        if batch is not None:
            self.batch = batch
        self.data = store[: self.batch]
        self._base_key = None  # row_base() changes with the capacity and the batch

    @property
    def capacity(self) -> int:
        return self.data.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes the buffer holds: its whole allocation (spare sequences too), or where it is mapped lazily, the
        columns written of its sequences (only those are resident)."""
        if self._map is None:
            return self.store.numel() * self.dtype.itemsize
        return self.batch * self.heads * self.length * self.width * self.dtype.itemsize

    def reserve(self, rows: int, room: bool = True) -> None:
        """Make room for `rows` rows in total, keeping the contents; with `room`, for growth past them too
        (a prefill's buffers then serve the decode steps after it without a copy at step 1)."""
        if rows <= self.capacity:
            return
        if room:
            capacity = max(rows + CHUNK, self.capacity + max(CHUNK, self.capacity // 2))
            capacity = -(-capacity // CHUNK) * CHUNK
        else:
            capacity = rows
        if self.max_rows is not None:
            if rows > self.max_rows:
                raise ValueError(f"{rows} rows asked of a buffer limited to {self.max_rows}")
            capacity = min(capacity, self.max_rows)
        store, mapping = self._alloc(self.store.shape[0], capacity)
        store[: self.batch, :, : self.length].copy_(self.valid())
        self._set(store, mapping)

    def append(self, x: torch.Tensor) -> None:
        """Append rows x (B, G, T, width), or values (B, G, T, d) to store as rows (model/kv.to_rows), after the
        valid ones."""
        T = x.shape[2]
        self.reserve(self.length + T)
        self.data[:, :, self.length : self.length + T].copy_(to_rows(x, self.dtype))
        self.length += T

    def zero_past_valid(self) -> None:
        """Zero the rows past the valid ones (a static step reads them, masked: masked garbage could be NaN)."""
        self.data[:, :, self.length :].zero_()

    def valid(self) -> torch.Tensor:
        """View of the valid rows: (B, G, length, width)."""
        return self.data[:, :, : self.length]

    def row_base(self, device=None) -> torch.Tensor:
        """(B, G, 1) int64: where each (sequence, head)'s rows start in the flattened buffer."""
        device = torch.device(device) if device is not None else self.device
        key = (self.capacity, device)
        if self._base_key != key:
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

    def put(self, slot: torch.Tensor, x: torch.Tensor) -> None:
        """Overwrite one row per (sequence, head): x (B, G, 1, width) (or values to store as rows) at slots slot (B, G)."""
        rows = (slot.unsqueeze(-1).to(self.device) + self.row_base()).view(-1)
        x = to_rows(x, self.dtype).reshape(-1, self.width)
        self.data.view(-1, self.width).index_copy_(0, rows, x.to(self.device, self.dtype))

    def reset(self) -> None:
        self.length = 0

    def drop_front(self, n: int) -> None:
        """Forget the first n valid rows: the rest move to the front (a sliding window's buffer)."""
        keep = self.length - n
        src = self.data[:, :, n : self.length]
        if keep > n:  # source and destination overlap
            src = src.clone()
        self.data[:, :, :keep].copy_(src)
        self.length = keep

    # --- continuous batching: sequences join and leave between decode steps ---------------------------

    def join(self, other: "RowBuffer", at_self: int, at_other: int, room: int = 0) -> None:
        """Append other's sequences (dim 0) after this buffer's; this one's rows move to column at_self and
        other's to at_other (left padding: zeros), `length` becomes the longer end, with capacity for `room`
        more rows. In place (a copy of other's rows) when this one's stay where they are and the store has
        the room; else one copy of each buffer into a new store."""
        n, B = max(self.length + at_self, other.length + at_other), self.batch
        total = B + other.batch
        moves = [(slice(B, total), other, at_other)]
        if at_self or total > self.store.shape[0] or n + room > self.capacity:
            # spare sequences for the next joins: free until written on lazily mapped memory, half as many again
            # in pinned memory (which they occupy: counted by nbytes, the server's pool figure)
            spare = 2 * total if self.spare else total + (total + 1) // 2 if self.pin else total
            store, mapping = self._alloc(spare, self._columns(n + room))
            moves.insert(0, (slice(0, B), self, at_self))
        else:
            store, mapping = self.store, self._map
            store[:B, :, self.length : n].zero_()
        for rows, src, at in moves:
            data = store[rows]
            data[:, :, :at].zero_()
            data[:, :, at : at + src.length].copy_(src.valid())
            data[:, :, at + src.length : n].zero_()
        self._set(store, mapping, total)
        self.length = n

    def retain(self, rows: list[int], trim: int = 0, room: int = 0) -> None:
        """Keep the sequences `rows` only, without their first `trim` columns (padding every row has), with
        capacity for `room` more rows. In place when nothing is trimmed and each kept sequence stays or
        moves into the place of one that left (a copy of the moved ones); else one copy into a new store."""
        n, k = self.length - trim, len(rows)
        if not trim and n + room <= self.capacity and all(r == i or r >= k for i, r in enumerate(rows)):
            for i, r in enumerate(rows):
                if r != i:
                    self.store[i, :, :n].copy_(self.store[r, :, :n])
            row = self.heads * self.capacity * self.width * self.dtype.itemsize
            release_pages(self._map, k * row, self.batch * row)  # the sequences that left
            self._set(self.store, self._map, k)
            return
        store, mapping = self._alloc(max(k, self.store.shape[0]) if self.spare else k, self._columns(n + room))
        for i, r in enumerate(rows):
            store[i, :, :n].copy_(self.data[r, :, trim : self.length])
        self._set(store, mapping, k)
        self.length = n

    def place(self, row: int, other: "RowBuffer", n: int) -> None:
        """Other's only sequence into sequence `row`, in place, ending at column n (its L <= n rows right-aligned:
        left padding zeros), the columns past n zeroed (a static step reads them, masked)."""
        L = other.length
        data = self.data[row]
        data[:, : n - L].zero_()
        data[:, n - L : n].copy_(other.data[0, :, :L])
        data[:, n:].zero_()

    def move_rows(self, dst: list[int], src: list[int]) -> None:
        """Sequences src copied whole into the places dst, in place (the batch's size stays)."""
        self.data[dst] = self.data[src]

    def _columns(self, needed: int) -> int:
        """Columns to allocate for `needed`: spare ones where they cost nothing until written, so that the
        sequences joining later fit without a new store (a multiple of CHUNK: each sequence's rows then
        start on a page, and release_pages frees them whole)."""
        columns = -(-(needed + CHUNK) // CHUNK) * CHUNK if self.spare else needed
        return min(columns, self.max_rows) if self.max_rows is not None else columns

    def __deepcopy__(self, memo) -> "RowBuffer":
        """A buffer of its own with the same valid rows (Rebatch.fork): a new allocation of the same kind."""
        twin = copy.copy(self)
        twin._set(*self._alloc(self.batch, self.capacity))
        twin.valid().copy_(self.valid())
        return twin

    def free(self) -> None:
        """Drop the contents and their memory."""
        self.length = 0
        self._set(*self._alloc(self.batch, 0))
