"""A layer of InfiniGenCache: its K/V in the host pool (layer 0 and a model's local layers: on the compute
device, attended whole), its partial key cache, and the decode step's hand-off from the speculation: `view`
takes the rows the previous layer's speculation chose (a Fetch, started by the cache) and returns the working
set attention reads, as a KVView (model/kv.py).
"""

from __future__ import annotations

import torch

from ...model import kernels
from ...model.kv import KVView
from ..base import LogicalLayer
from ..rows import RowBuffer
from . import int8
from .pool import Slots
from .speculator import approx_scores, relative


class InfiniGenLayer(LogicalLayer):
    def __init__(self, cache, layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        # A dense layer attends over all of its cache, which lives on the device (InfiniGen's layer 0: it has
        # no previous layer to speculate from); every other layer lives in the pool.
        self.dense = cache.selection.dense(cache, layer_idx)
        # A dense layer with a sliding window (Gemma's local layers) keeps only the window (LogicalLayer.slide),
        # not the whole context: on a GPU it stays on the device at the window's size.
        self.window = cache.arch.windows[layer_idx] if self.dense else None
        self.seen = 0  # tokens seen (the logical length); the pool holds fewer once it has evicted
        self.slots = None  # positions and fetch statistics of the pool's slots, when it has a capacity
        self.max_rows = None  # rows per (sequence, head) a byte-limited pool may hold
        self.prefill_query = None  # (x, rope, keep) of a prompt's last position, when a prefill may overflow
        self.mirror = None  # (k, v) RowBuffers on the device of a prompt being prefilled in chunks (CudaTransfer)
        self.skew_p = self.partial = self.key_channels = None  # A_P (G, d, p), partial key cache, raw channels (G, p)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, G, _, d = key_states.shape
        dev, dtype = key_states.device, key_states.dtype
        on_gpu = dev.type == "cuda"
        pool_dev = dev if (self.dense or not on_gpu) else torch.device("cpu")
        pin = pool_dev.type == "cpu" and on_gpu
        c = self.cache.config
        calibrated = self.cache.selection.calibrated and not self.dense  # a dense layer is never scored
        if calibrated and (c.capacity is not None or c.capacity_bytes is not None):
            self.slots = Slots(B, G, dev, c.eviction)
            if c.capacity_bytes is not None:
                row = G * (d + value_states.shape[-1]) * key_states.element_size()  # one token, all KV heads
                self.max_rows = max(1, c.capacity_bytes // row)
        self.k = RowBuffer(B, G, d, dtype, pool_dev, pin=pin, max_rows=self.max_rows)
        self.v = RowBuffer(B, G, value_states.shape[-1], dtype, pool_dev, pin=pin, max_rows=self.max_rows)
        self.skew_p = self.partial = self.key_channels = None
        if calibrated:
            self.skew_p = self.cache.skew_partial[self.layer_idx].to(dev, dtype)  # (G, d, p)
            if self.cache.calibration.unskewed:  # A_P selects raw channels: a gather, not a product
                self.key_channels = self.cache.calibration.channels[self.layer_idx].to(dev).contiguous()  # (G, p)
            pdt = self.cache.partial_dtype(dtype, dev)
            width = self.skew_p.shape[-1] + (4 if pdt == torch.int8 else 0)  # int8 rows end with their scale
            self.partial = RowBuffer(B, G, width, pdt, dev,
                                     max_rows=self.max_rows)
            pq = self.cache.pq
            if pq.rows is not None and (dev.type != "cpu" or kernels.cpu() is None):
                pq.rows_on(self.layer_idx, dev)  # its partial query's q_proj rows, made now, not in decode
        self.device = dev  # this layer's compute device (layers may sit on different GPUs: device_map)
        self.transfer = self.cache.transfer_for(dev)
        reserved = self.cache.reserved
        if reserved:  # the whole run's rows now: no pool grows (or re-pins) inside decode
            rows = self.limit(reserved) or self.rows_for(reserved)
            for buf in (self.k, self.v, self.partial):
                if buf is not None:
                    buf.reserve(rows, room=False)
        self.is_initialized = True
        self.prepare_transfer()

    def prepare_transfer(self) -> None:
        """The transfer's events and staging for this layer's decode steps, sized for the run (cache.reserve) or
        its pool's capacity: made at its prefill, a fork, a join or a retain, not inside decode (CudaTransfer)."""
        if not hasattr(self.transfer, "init_layer"):
            return
        selection, reserved = self.cache.selection, self.cache.reserved
        tokens = reserved if reserved > self.seen else self.k.capacity
        rows = 0 if self.dense else selection.max_fetch(self.cache, self.layer_idx, tokens)
        self.transfer.init_layer(self, self.k.batch, self.k.heads, rows, not selection.whole)

    @torch.no_grad()  # an inference cache: stored K/V never carry gradients
    def view(self, key_states, value_states, fetch=None) -> KVView:
        """fetch: the rows the previous layer's selection chose for this decode step, its prefetch started."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        transfer = self.transfer
        past, T = self.seen, key_states.shape[2]
        pending = fetch
        if pending is not None:
            pending = transfer.ready(self, pending)  # the prefetch of this layer is complete
        if self.slots is not None and self.slots.evicted and (pending is None or T > 1):
            raise NotImplementedError("a pool that has evicted entries serves one decode token per step: "
                                      "make a new cache per prompt")
        if pending is None or T > 1:  # prefill, or a dense decode step
            self.store(key_states, value_states)
            self.seen += T
            if past == 0:
                return KVView(key_states, value_states)  # prefill: attend over the prompt itself
            if T == 1:
                self.cache.counters.count_dense(self, self.cache.arch.windows[self.layer_idx])
            k, v = transfer.dense(self)
            return KVView(k, v, offset=self.offset, buffers=(self.k.data, self.v.data))
        # A decode step over the rows chosen one layer ahead: fetch them from the pool as the last step left
        # it, then store the new token (on a full pool it may overwrite one of the chosen: read in place
        # only when it is appended).
        got = transfer.fetch(self, pending, key_states, value_states,
                             in_place=self.cache.selection.in_place and not self.evicts_next())
        new = self.store(key_states, value_states)
        self.seen += 1
        if got is None:  # the CPU kernel reads [new token, chosen rows] where they lie in the pool
            return KVView(self.k.data, self.v.data, selected=True, chosen=(pending.idx, pending.count, new),
                          rows=pending.idx)
        K, V, mask = got
        return KVView(K, V, selected=True, mask=mask, rows=pending.idx)

    def limit(self, seen: int) -> int | None:
        """Entries the pool may hold per (sequence, KV head) after `seen` tokens (None: no limit)."""
        if self.slots is None:
            return None
        c = self.cache.config
        limits = [self.max_rows] if self.max_rows is not None else []
        if c.capacity is not None:
            limits.append(max(1, int(c.capacity * seen)))
        return min(limits)

    def evicts_next(self) -> bool:
        """Whether one more token makes the pool overwrite an entry."""
        limit = self.limit(self.seen + 1)
        return limit is not None and self.k.length + 1 > limit

    def store(self, k: torch.Tensor, v: torch.Tensor):
        """The new rows k, v (B, G, T, d) into the pool and their skewed channels into the partial key
        cache; a full pool overwrites the slot its eviction policy names (one per new token), and a
        prefill larger than the pool keeps its most recent tokens. Returns where the last row went: its slot
        (an int: appended) or the slots (B, G) it overwrote."""
        transfer, past, T = self.transfer, self.seen, k.shape[2]
        limit = self.limit(past + T)
        if limit is not None and T == 1 and self.k.length + 1 > limit:
            slot = self.slots.victim()  # (B, G)
            transfer.write(self, k, v, slot)
            self.partial.put(slot, self.partial_rows(k))
            self.slots.replace(slot, past)
            return slot
        k, v = self.slide(k, v)
        pos = None
        if limit is not None and self.k.length + T > limit:  # only a first prefill gets here (see update)
            drop = self.k.length + T - limit
            if self.slots.policy == "fifo" or self.prefill_query is None:
                k, v, past, T = k[:, :, drop:], v[:, :, drop:], past + drop, T - drop  # the most recent
            else:
                pos = self.prefill_keep(k, T - drop)  # (B, G, kept) positions within the prompt, in order
                k, v = (t.gather(2, pos.unsqueeze(-1).expand(-1, -1, -1, t.shape[-1])) for t in (k, v))
                pos, T = pos + past, T - drop
            self.slots.evicted += drop
        self.prefill_query = None
        if not (T == 1 and self.append_token(k, v)):
            transfer.write(self, k, v)
            if self.partial is not None:
                self.partial.append(self.partial_rows(k))  # (B, G, T, p), or int8 (B, G, T, p + 4)
        if self.slots is not None:
            self.slots.append(past, T, pos)
        return self.k.length - 1

    def append_token(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        """A decode token's k, v (B, G, 1, d) into the pool and its int8 partial key row into the partial key cache
        in one kernel call (`store_token`: the same bytes as transfer.write and partial.append, without their ~8
        ops). False where that does not serve: no kernel, a GPU's transfer, a skewed or non-int8 partial cache."""
        kern = kernels.cpu()
        if (kern is None or self.partial is None or self.key_channels is None or self.partial.dtype != torch.int8
                or not self.transfer.host_compute or self.k.dtype != torch.float32 or k.dtype != torch.float32
                or k.device.type != "cpu" or not self.v.length == self.partial.length == self.k.length):
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
        return int8.pack(kp) if self.partial.dtype == torch.int8 else kp.to(self.partial.dtype)

    def prefill_keep(self, k: torch.Tensor, n: int) -> torch.Tensor:
        """The n prompt tokens a pool too small for its prompt keeps under lru/counter, which have no
        fetch statistics yet: those the prompt's last query attends most by the speculation's own partial
        scores (the tokens the first decode steps will fetch; attention sinks among them). k (B, G, T, d)
        -> positions (B, G, n), ascending."""
        x, rope, keep = self.prefill_query
        q = self.cache.partial_query(self.layer_idx, x, rope)  # (B, G, r, p)
        kp = self.partial_rows(k)  # as the partial key cache would store them
        scores = approx_scores(q, kp, self.cache.arch.score_scale)  # (B, G, r, T)
        rel = relative(scores, keep, self.cache.config.gqa_combine)  # (B, G, T), padding at -inf
        rel[..., -1] = float("inf")  # the last token is always kept (it is the next step's neighbour)
        return rel.topk(n, dim=-1, sorted=False).indices.sort(dim=-1).values

    def get_seq_length(self) -> int:
        return self.seen if self.is_initialized else 0

    def restore(self, parts: list[list[torch.Tensor]], tokens: int) -> None:
        super().restore(parts, tokens)
        self.seen = tokens

    def row_buffers(self) -> list:
        if self.slots is not None:  # slots are not positions once a pool may evict
            raise NotImplementedError("continuous batching needs a pool without a capacity (capacity, capacity_bytes)")
        return [b for b in (self.k, self.v, self.partial) if b is not None]

    def join(self, other, at_self: int, at_other: int, room: int) -> None:
        super().join(other, at_self, at_other, room)
        self.seen += at_self
        self._clear_step()
        self.prepare_transfer()  # staging for the new batch size

    def retain(self, rows, trim: int, room: int) -> None:
        super().retain(rows, trim, room)
        self.seen -= trim
        self._clear_step()
        self.prepare_transfer()

    def _clear_step(self) -> None:
        """Forget the last step's fetch (sized for the batch it ran with)."""
        self.prefill_query = self.mirror = None

    def reset(self) -> None:
        self.seen = self.offset = 0
        if self.slots is not None:
            self.slots.reset()
        if self.is_initialized:
            for buf in (self.k, self.v, self.partial):
                if buf is not None:
                    buf.reset()
        self._clear_step()

    @property
    def nbytes(self) -> int:
        return (self.k.nbytes + self.v.nbytes) if self.is_initialized else 0
