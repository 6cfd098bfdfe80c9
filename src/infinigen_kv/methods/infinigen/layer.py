"""The layers of InfiniGenCache, one class per storage kind, each built from a `LayerConfig` (no reference back to
the cache):

- `DeviceLayer`: K/V on the compute device, attended whole (InfiniGen's layer 0, which has no previous layer to
  speculate from, and a model's local layers);
- `PoolLayer`: K/V in the host pool and, when calibrated, the partial key cache; a decode step's `view` takes the
  rows the previous layer's speculation chose (a Fetch) and returns the working set attention reads (a KVView,
  model/kv.py);
- `EvictingPoolLayer` (evicting_pool.py): a pool with a capacity, which overwrites entries by its eviction policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...config import InfiniGenConfig
from ...model import int8_rows
from ...model.kv import KVView, kv_storage, row_width
from ..base import LogicalLayer
from ..rows import RowBuffer
from .contracts import Transfer
from .fetch import Fetch
from .speculator import fetch_cap
from .stats import Counters
from .store_row import store_row


@dataclass(frozen=True)
class LayerConfig:
    """What a layer of InfiniGenCache is built from (the cache makes it)."""

    layer_idx: int
    config: InfiniGenConfig
    transfers: object  # cache.Transfers: the transfer engine of each compute device
    counters: Counters  # the cache's fetch statistics
    window: int | None  # the layer's attention window (None: global)
    backend: object = None  # the model's backend (model/backend.py): what runs the layer's operations
    whole: bool = False  # the selection fetches whole pasts (offload), not chosen rows
    in_place: bool = False  # on CPU, attention may read the chosen rows where they lie in the pool
    skew_p: torch.Tensor | None = None  # (G, d, p) A_P of a calibrated layer
    key_channels: torch.Tensor | None = None  # (G, p) raw channels, where A_P selects them (a gather)
    pq: object = None  # the cache's PartialQuery (partial.py)
    score_scale: float = 1.0


def partial_dtype(option: str, dtype: torch.dtype, device: torch.device, backend) -> torch.dtype:
    """Storage of the partial key cache for a model computing in `dtype` on `device` (config.partial_dtype):
    "auto" stores int8 rows where the CPU kernel scores them (integer dot products, scores in float32), bfloat16 on
    a GPU (half float32's device memory; one kernel widens each key as it reads it: partial_scores.py), and float32
    elsewhere, where the scores are computed in PyTorch in float32 (no conversion per step)."""
    if option == "model":
        return dtype
    if option == "int8":
        return torch.int8
    if option == "bfloat16":
        return torch.bfloat16
    if option == "float32":
        return torch.float32
    if dtype == torch.float32 and torch.device(device).type == "cpu" and backend.kernels:
        return torch.int8
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


class DeviceLayer(LogicalLayer):
    """K/V on the compute device, attended whole, in place where the backend reads it so."""

    dense = True  # attended over all it holds; never scored, never fetched from
    slots = None  # an evicting pool's slot records (EvictingPoolLayer)
    skew_p = partial = key_channels = None  # a calibrated pool layer's A_P, partial key cache and raw channels

    def __init__(self, spec: LayerConfig, budget: float = 1.0):
        super().__init__()
        self.spec, self.layer_idx, self.budget = spec, spec.layer_idx, budget
        self.seen = 0  # tokens seen (the logical length); an evicting pool holds fewer
        self.reserved = 0  # rows the buffers are made with (InfiniGenCache.reserve)
        self.mirror = None  # (k, v) RowBuffers on the device of a prompt being prefilled in chunks (CudaTransfer)
        self.transfer: Transfer | None = None
        self.backend = spec.backend  # the model's; for the device this layer computes on once it is made
        self._static_mask = None  # (B, G, 1, m + 1) bool: a static step's working-set mask (PoolLayer.static_mask)
        # A dense layer with a sliding window (Gemma's local layers) keeps only the window (LogicalLayer.slide).
        self.window = spec.window if self.dense else None

    def pool_device(self, dev: torch.device) -> torch.device:
        return dev

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, G, _, d = key_states.shape
        dev, dtype = key_states.device, key_states.dtype
        self.device = dev  # this layer's compute device (layers may sit on different GPUs: device_map)
        self.backend = self.spec.backend.on(dev.type)  # the model's, for the device this layer computes on
        self.transfer = self.spec.transfers.for_device(dev)
        pool_dev = self.pool_device(dev)
        pin = pool_dev.type == "cpu" and dev.type == "cuda"
        self.make_buffers(B, G, d, value_states.shape[-1], dtype, dev, pool_dev, pin)
        if self.reserved:  # the whole run's rows now: no pool grows (or re-pins) inside decode
            rows = self.limit(self.reserved) or self.rows_for(self.reserved)
            for buf in self.buffers():
                buf.reserve(rows, room=False)
        self.is_initialized = True
        self.prepare_transfer()

    def make_buffers(self, B, G, d, dv, dtype, dev, pool_dev, pin, max_rows=None) -> None:
        """K, V in kv_dtype's storage for a model computing in `dtype` (config.KV_DTYPES)."""
        kv = kv_storage(self.spec.config.kv_dtype, dtype, dev)
        self.k = RowBuffer(B, G, row_width(d, kv), kv, pool_dev, pin=pin, max_rows=max_rows)
        self.v = RowBuffer(B, G, row_width(dv, kv), kv, pool_dev, pin=pin, max_rows=max_rows)

    def limit(self, seen: int) -> int | None:
        """Entries the pool may hold per (sequence, KV head) after `seen` tokens (None: no limit)."""
        return None

    def max_fetch(self, tokens: int) -> int:
        """The most rows one decode step fetches per (sequence, KV head) up to `tokens` tokens."""
        return 0

    def prepare_transfer(self) -> None:
        """The transfer's events and staging for this layer's decode steps, sized for the run (reserve) or its
        pool's capacity: made at its prefill, a fork, a join or a retain, not inside decode (CudaTransfer)."""
        tokens = self.reserved if self.reserved > self.seen else self.k.capacity
        self.transfer.init_layer(self, self.k.batch, self.k.heads, self.max_fetch(tokens), not self.spec.whole)

    @torch.no_grad()  # an inference cache: stored K/V never carry gradients
    def view(self, key_states, value_states, fetch=None, at: torch.Tensor | None = None) -> KVView:
        """Store the new k, v (B, G, T, d); the prompt attends over itself, a decode step over all the layer holds.
        fetch: unused here (what a pool layer's previous layer chose); at (1,): a static step's device column."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if at is not None:
            self.store_at(key_states, value_states, at)
            return KVView(self.k.data, self.v.data)  # the whole buffers: the step's mask marks what is valid
        return self.dense_view(key_states, value_states, fetch)

    def store_at(self, k: torch.Tensor, v: torch.Tensor, at: torch.Tensor) -> None:
        """A static step's row k, v (B, G, 1, d) at column `at` (1,), through the layer's transfer (the host's
        lengths follow after the step: InfiniGenCache.advanced)."""
        self.transfer.write_at(self, k, v, at)

    def dense_view(self, key_states, value_states, hint) -> KVView:
        past, T = self.seen, key_states.shape[2]
        self.store(key_states, value_states, hint)
        self.seen += T
        if past == 0:
            return KVView(*self.as_stored(key_states, value_states))  # prefill: attend over the prompt itself
        if T == 1:
            self.spec.counters.count_dense(self, self.spec.window)
        k, v = self.transfer.dense(self)
        return KVView(k, v, offset=self.offset, buffers=(self.k.data, self.v.data))

    def store(self, k: torch.Tensor, v: torch.Tensor, hint=None):
        """The new rows k, v (B, G, T, d) into the layer's buffers (a window's: slid). Returns the last row's slot."""
        k, v = self.slide(k, v)
        self.transfer.write(self, k, v)
        return self.k.length - 1

    def get_seq_length(self) -> int:
        return self.seen if self.is_initialized else 0

    def restore(self, parts: list[list[torch.Tensor]], tokens: int) -> None:
        super().restore(parts, tokens)
        self.seen = tokens

    def buffers(self) -> list:
        """The layer's RowBuffers."""
        return [self.k, self.v]

    def row_buffers(self) -> list:
        return self.buffers()

    def join(self, other, at_self: int, at_other: int, room: int) -> None:
        super().join(other, at_self, at_other, room)
        self.seen += at_self
        self.reserved = self.seen + room  # the joined run's tokens (a static step's columns: static_columns)
        self.mirror = None
        self.prepare_transfer()  # staging for the new batch size

    def retain(self, rows, trim: int, room: int) -> None:
        super().retain(rows, trim, room)
        self.seen -= trim
        self.reserved = self.seen + room
        self.mirror = None
        self.prepare_transfer()

    def reset(self) -> None:
        self.seen = self.offset = 0
        if self.is_initialized:
            for buf in self.buffers():
                buf.reset()
        self.mirror = None

    @property
    def nbytes(self) -> int:
        return (self.k.nbytes + self.v.nbytes) if self.is_initialized else 0


class PoolLayer(DeviceLayer):
    """K/V in the host pool (on a GPU: pinned host memory; on CPU: where attention runs) and, when calibrated, the
    partial key cache: k A_P of every stored key, (B, G, n, p), or int8 rows (B, G, n, p + 4)."""

    dense = False

    def pool_device(self, dev: torch.device) -> torch.device:
        return torch.device("cpu") if dev.type == "cuda" else dev

    def make_buffers(self, B, G, d, dv, dtype, dev, pool_dev, pin, max_rows=None) -> None:
        super().make_buffers(B, G, d, dv, dtype, dev, pool_dev, pin, max_rows)
        s = self.spec
        self.skew_p = self.partial = self.key_channels = None
        if s.skew_p is None:  # not calibrated (offload): nothing is scored
            return
        self.skew_p = s.skew_p.to(dev, dtype)  # (G, d, p)
        if s.key_channels is not None:
            self.key_channels = s.key_channels.to(dev).contiguous()  # (G, p)
        pdt = partial_dtype(s.config.partial_dtype, dtype, dev, self.backend)
        width = self.skew_p.shape[-1] + (4 if pdt == torch.int8 else 0)  # int8 rows end with their scale
        self.partial = RowBuffer(B, G, width, pdt, dev, max_rows=max_rows)
        if s.pq.rows is not None and not self.backend.kernels:
            s.pq.rows_on(self.layer_idx, dev)  # its partial query's q_proj rows, made now, not in decode
            s.pq.channels_on(dev)  # (and every layer's channels: a copy from the host would wait in a step)

    def max_fetch(self, tokens: int) -> int:
        c = self.spec.config
        return tokens if self.spec.whole else fetch_cap(tokens, self.budget, c.max_num_kv, c.min_budget)

    @torch.no_grad()
    def view(self, key_states, value_states, fetch=None, at: torch.Tensor | None = None) -> KVView:
        """fetch: the rows the previous layer's selection chose for this decode step, its prefetch started (None:
        a prefill, or a dense step); at (1,): a static step's device column (the working set's shapes are fixed)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if at is not None:
            return self.static_view(key_states, value_states, fetch, at)
        if fetch is None or key_states.shape[2] > 1 or not self.selected(fetch):
            return self.dense_view(key_states, value_states, fetch)
        fetch = self.transfer.ready(self, fetch)  # the prefetch of this layer is complete
        # A decode step over the rows chosen one layer ahead: fetch them from the pool as the last step left
        # it, then store the new token (on a full pool it may overwrite one of the chosen: read in place
        # only when it is appended).
        got = self.transfer.fetch(self, fetch, key_states, value_states,
                                  in_place=self.spec.in_place and not self.evicts_next())
        new = self.store(key_states, value_states)
        self.seen += 1
        if got is None:  # the CPU kernel reads [new token, chosen rows] where they lie in the pool
            return KVView(self.k.data, self.v.data, selected=True, chosen=(fetch.idx, fetch.count, new),
                          rows=fetch.idx)
        K, V, mask = got
        return KVView(K, V, selected=True, mask=mask, rows=fetch.idx)

    def static_view(self, key_states, value_states, fetch, at: torch.Tensor) -> KVView:
        """A static step: the chosen rows (a fixed number of slots, the first `count` real) as the working set, then
        the new row stored at column `at`; without a fetch (a layer not yet scored), the whole buffers."""
        if fetch is None:
            return super().view(key_states, value_states, None, at)
        fetch = self.transfer.ready(self, fetch)
        K, V, mask = self.transfer.fetch(self, fetch, key_states, value_states, in_place=False)
        self.store_fixed(key_states, value_states, at, K, V)
        return KVView(K, V, selected=True, mask=mask, rows=fetch.idx)

    def static_mask(self, B: int, G: int, m: int) -> torch.Tensor:
        """(B, G, 1, m + 1) bool, the mask of a static step's working set [new token, m chosen slots]: column 0
        True, the rest written by the speculation (which slots are real). One buffer a layer, made at its first
        static step (before a CUDA graph captures one)."""
        mask = self._static_mask
        if mask is None or mask.shape != (B, G, 1, m + 1):
            mask = self._static_mask = torch.ones(B, G, 1, m + 1, dtype=torch.bool, device=self.device)
        return mask

    def store_fixed(self, k: torch.Tensor, v: torch.Tensor, at: torch.Tensor, K: torch.Tensor, V: torch.Tensor):
        """A static step's new row k, v (B, G, 1, d): into the pool at column `at` (1,), into slot 0 of the working
        set K, V (B, G, m + 1, d) (int8 rows: quantized by the op), and its partial key into the partial key cache,
        in one op (store_row.py) where the partial keys are raw channels stored as floats; else the partial key by its
        own ops."""
        pool_k, pool_v = self.transfer.device_pool(self)
        fused = self.key_channels is not None and self.partial.dtype != torch.int8  # (int8 K/V rows: quantized in it)
        store_row(k, v, pool_k, pool_v, at, K, V, self.partial.data if fused else None,
                  self.key_channels if fused else None)
        if self.partial is not None and not fused:
            self.partial.data.index_copy_(2, at, self.partial_rows(k))

    def store_at(self, k: torch.Tensor, v: torch.Tensor, at: torch.Tensor) -> None:
        super().store_at(k, v, at)  # the pool: on a GPU, pinned host memory
        if self.partial is not None:
            self.partial.data.index_copy_(2, at, self.partial_rows(k))

    @staticmethod
    def selected(hint) -> bool:
        """Whether a view's hint is a decode step's fetch (not an evicting pool's prefill query)."""
        return isinstance(hint, Fetch)

    def evicts_next(self) -> bool:
        """Whether one more token makes the pool overwrite an entry."""
        return False

    def store(self, k: torch.Tensor, v: torch.Tensor, hint=None):
        """The new rows k, v (B, G, T, d) into the pool and their partial keys into the partial key cache. Returns
        the last row's slot (an int)."""
        if not (k.shape[2] == 1 and self.append_token(k, v)):
            self.transfer.write(self, k, v)
            if self.partial is not None:
                self.partial.append(self.partial_rows(k))  # (B, G, T, p), or int8 (B, G, T, p + 4)
        return self.k.length - 1

    def append_token(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        """A decode token's k, v (B, G, 1, d) into the pool and its int8 partial key row into the partial key cache
        in one kernel call (`store_token`: the same bytes as transfer.write and partial.append, without their ~8
        ops). False where that does not serve: no kernel, a GPU's transfer, a skewed or non-int8 partial cache."""
        kern = self.backend.ops
        if (kern is None or self.partial is None or self.key_channels is None or self.partial.dtype != torch.int8
                or not self.transfer.host_compute or self.k.dtype not in (torch.float32, torch.bfloat16, torch.int8)
                or k.dtype != torch.float32
                or not self.v.length == self.partial.length == self.k.length):
            return False
        at = self.k.length
        for buf in (self.k, self.v, self.partial):
            buf.reserve(at + 1)
        kern.store_token(self.k.data, self.v.data, self.partial.data, k, v, self.key_channels, at)
        for buf in (self.k, self.v, self.partial):
            buf.length = at + 1
        return True

    def partial_keys(self, k: torch.Tensor) -> torch.Tensor:
        """Skewed partial channels k A_P of keys k (B, G, T, d): (B, G, T, p)."""
        if self.key_channels is not None:
            B, G, T, _ = k.shape
            return k.gather(-1, self.key_channels.view(1, G, 1, -1).expand(B, G, T, -1))
        return torch.matmul(k, self.skew_p)

    def partial_rows(self, k: torch.Tensor) -> torch.Tensor:
        """The partial keys of k (B, G, T, d) as the partial key cache stores them: in its dtype, or int8 rows."""
        kp = self.partial_keys(k)
        return int8_rows.pack(kp) if self.partial.dtype == torch.int8 else kp.to(self.partial.dtype)

    def buffers(self) -> list:
        return [b for b in (self.k, self.v, self.partial) if b is not None]
