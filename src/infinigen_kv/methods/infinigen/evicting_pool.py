"""A host pool with a capacity (config `capacity`, a share of the tokens seen, or `capacity_bytes`): once full, each
new token overwrites the slot its eviction policy names (pool.py: fifo, lru, counter), and a prompt larger than the
pool keeps its most recent tokens (fifo) or those its last query would fetch (lru, counter)."""

from __future__ import annotations

import torch

from ...model.kv import KVView, kv_storage, row_width
from .fetch import PrefillQuery
from .layer import PoolLayer
from .pool import Slots
from .speculator import approx_scores, relative


class EvictingPoolLayer(PoolLayer):
    def make_buffers(self, B, G, d, dv, dtype, dev, pool_dev, pin, max_rows=None) -> None:
        c = self.spec.config
        self.slots = Slots(B, G, dev, c.eviction)  # positions and fetch statistics of the pool's slots
        self.max_rows = None  # rows per (sequence, head) a byte-limited pool may hold
        if c.capacity_bytes is not None:
            kv = kv_storage(c.kv_dtype, dtype, dev)
            row = G * (row_width(d, kv) + row_width(dv, kv)) * kv.itemsize  # one token, all KV heads, as stored
            self.max_rows = max(1, c.capacity_bytes // row)
        super().make_buffers(B, G, d, dv, dtype, dev, pool_dev, pin, self.max_rows)

    def view(self, key_states, value_states, fetch=None) -> KVView:
        if (self.is_initialized and self.slots.evicted
                and (not self.selected(fetch) or key_states.shape[2] > 1)):
            raise NotImplementedError("a pool that has evicted entries serves one decode token per step: "
                                      "make a new cache per prompt")
        return super().view(key_states, value_states, fetch)

    def limit(self, seen: int) -> int | None:
        c = self.spec.config
        limits = [self.max_rows] if self.max_rows is not None else []
        if c.capacity is not None:
            limits.append(max(1, int(c.capacity * seen)))
        return min(limits)

    def evicts_next(self) -> bool:
        return self.k.length + 1 > self.limit(self.seen + 1)

    def store(self, k: torch.Tensor, v: torch.Tensor, hint=None):
        """The new rows k, v (B, G, T, d) into the pool: a full pool overwrites the slot its eviction policy names
        (one per new token), and a prefill larger than the pool keeps what `hint` (a PrefillQuery) would fetch, or
        its most recent tokens. Returns where the last row went: its slot (an int: appended) or the slots (B, G)
        it overwrote."""
        past, T = self.seen, k.shape[2]
        limit = self.limit(past + T)
        if T == 1 and self.k.length + 1 > limit:
            slot = self.slots.victim()  # (B, G)
            self.transfer.write(self, k, v, slot)
            self.partial.put(slot, self.partial_rows(k))
            self.slots.replace(slot, past)
            return slot
        pos = None
        if self.k.length + T > limit:  # only a first prefill gets here
            drop = self.k.length + T - limit
            if self.slots.policy == "fifo" or not isinstance(hint, PrefillQuery):
                k, v, past, T = k[:, :, drop:], v[:, :, drop:], past + drop, T - drop  # the most recent
            else:
                pos = self.prefill_keep(k, T - drop, hint)  # (B, G, kept) positions within the prompt, in order
                k, v = (t.gather(2, pos.unsqueeze(-1).expand(-1, -1, -1, t.shape[-1])) for t in (k, v))
                pos, T = pos + past, T - drop
            self.slots.evicted += drop
        slot = super().store(k, v)
        self.slots.append(past, T, pos)
        return slot

    def prefill_keep(self, k: torch.Tensor, n: int, query: PrefillQuery) -> torch.Tensor:
        """The n prompt tokens a pool too small for its prompt keeps under lru/counter, which have no fetch
        statistics yet: those the prompt's last query attends most by the speculation's own partial scores (the
        tokens the first decode steps will fetch; attention sinks among them). k (B, G, T, d) -> positions
        (B, G, n), ascending."""
        s = self.spec
        q = s.pq(self.layer_idx, query.x, query.rope, self.skew_p, {}, self.backend)  # (B, G, r, p)
        kp = self.partial_rows(k)  # as the partial key cache would store them
        scores = approx_scores(q, kp, s.score_scale)  # (B, G, r, T)
        rel = relative(scores, query.keep, s.config.gqa_combine)  # (B, G, T), padding at -inf
        rel[..., -1] = float("inf")  # the last token is always kept (it is the next step's neighbour)
        return rel.topk(n, dim=-1, sorted=False).indices.sort(dim=-1).values

    def row_buffers(self) -> list:
        raise NotImplementedError("continuous batching needs a pool without a capacity (capacity, capacity_bytes)")

    def reset(self) -> None:
        super().reset()
        if self.is_initialized:
            self.slots.reset()
