"""Fixed-budget caches that evict for good (StreamingLLM, H2O): the shared layer.

Each layer keeps at most cap_b = max(ceil(budget x valid tokens seen), min_budget) entries per (sequence, KV head), in slots
[0, kept_b) of compact buffers, with each entry's original position (and, for H2O, its accumulated
attention). After the prefill, which attends over everything, the layer keeps the cap_b entries the
policy ranks highest; each decode step the new token takes a free slot while kept_b < cap_b, else the
slot of the entry the policy evicts. Attention runs over the slots with a slot mask, handed to it in the
layer's view (model/kv.py) like InfiniGen's working set.
"""

from __future__ import annotations

import torch

from ..config import DEFAULT_BUDGET, DEFAULT_MIN_BUDGET, check_budget, check_kv_dtype, check_min_budget
from ..model.arch import get_arch
from ..model.kv import KVView, kv_storage, row_width, to_rows
from .base import LogicalLayer, Rebatch
from .budget import budget_caps
from .keep import keep_source, valid_keys
from .rows import RowBuffer


class EvictingLayer(LogicalLayer):

    def __init__(self, cache: "EvictingCache", layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.window = cache.arch.windows[layer_idx]  # sliding window (None: global): attention stays inside it
        self.compact_due = False
        self.steps = self.bytes_read = 0  # decode steps, and the KV bytes their attention read (the kept slots)

    def lazy_initialization(self, key_states, value_states) -> None:
        B, G, _, d = key_states.shape
        dev = key_states.device
        dtype = kv_storage(self.cache.kv_dtype, key_states.dtype, dev)
        self.k = RowBuffer(B, G, row_width(d, dtype), dtype, dev)
        self.v = RowBuffer(B, G, row_width(value_states.shape[-1], dtype), dtype, dev)
        self.pos = RowBuffer(B, G, 1, torch.long, dev)  # original position of each slot
        self.score = RowBuffer(B, G, 1, torch.float32, dev)  # accumulated attention (H2O)
        self.seen = 0  # logical length
        self.kept = torch.zeros(B, dtype=torch.long, device=dev)  # slots in use per sequence
        self.n_valid = torch.zeros(B, dtype=torch.long, device=dev)  # unpadded tokens seen per sequence
        self.first = torch.zeros(B, dtype=torch.long, device=dev)  # position of each sequence's first token
        self.is_initialized = True

    # --- policy hooks (overridden by the methods) ---
    def priority(self, positions: torch.Tensor, scores: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
        """Higher = kept. positions (B, G, m), scores (B, G, m), cap (B,): -> (B, G, m) float."""
        raise NotImplementedError

    def _caps(self) -> torch.Tensor:
        return self.cache.entries(self.n_valid)  # (B,)

    @torch.no_grad()
    def view(self, key_states, value_states, fetch=None) -> KVView:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        T = key_states.shape[2]
        if T > 1 and self.seen > 0 and not self.compact_due:
            raise NotImplementedError(f"{self.cache.method}: a multi-token forward after decoding has started "
                                      "is not supported (evicted entries are gone); use a new cache per prompt")
        if self.seen == 0 or T > 1:  # prefill: keep everything for now, attend over everything
            keep = fetch  # (B, T) valid positions of this forward (the cache's before_attention), or None
            B, G = key_states.shape[:2]
            for buf, x in ((self.k, key_states), (self.v, value_states)):
                buf.append(x)
            pos = torch.arange(self.seen, self.seen + T, device=key_states.device)
            self.pos.append(pos.view(1, 1, T, 1).expand(B, G, T, 1))
            self.score.append(torch.zeros(B, G, T, 1, device=key_states.device))
            valid = keep.sum(-1) if keep is not None else torch.full_like(self.n_valid, T)
            if self.seen == 0:
                self.first = T - valid  # left padding
            self.n_valid += valid
            self.seen += T
            self.kept.fill_(self.k.length)
            self.compact_due = True
            scores = self if self.needs_probs else None
            if self.seen == T:
                return KVView(*self.as_stored(key_states, value_states), scores=scores)
            return KVView(self.k.valid(), self.v.valid(), scores=scores)
        if self.compact_due:
            self._compact()
        self.n_valid += 1
        cap = self._caps()
        full = self.kept >= cap  # (B,)
        slot = self._victims(cap).masked_fill(~full.view(-1, 1), 0) + torch.where(full, 0, self.kept).view(-1, 1)
        B, G = slot.shape
        need = int(slot.max()) + 1
        for buf in self.row_buffers():
            if need > buf.length:
                buf.reserve(need)
                buf.data[:, :, buf.length : need].zero_()
                buf.length = need
        rows = (slot.view(B, G, 1) + self.k.row_base()).view(-1)
        self.k.data.view(-1, self.k.width).index_copy_(0, rows, to_rows(key_states, self.k.dtype).reshape(-1, self.k.width))
        self.v.data.view(-1, self.v.width).index_copy_(0, rows, to_rows(value_states, self.v.dtype).reshape(-1, self.v.width))
        self.pos.data.view(-1).index_fill_(0, rows, self.seen)
        self.score.data.view(-1).index_fill_(0, rows, 0.0)
        self.kept += (~full).long()
        self.seen += 1
        m = self.k.length
        slots = torch.arange(m, device=slot.device)
        mask = (slots < self.kept.view(-1, 1)).view(B, 1, 1, m)  # (B, 1, 1, m): same for all heads
        if self.window is not None and self.seen > self.window:  # kept entries the window has left: masked
            inside = self.pos.valid()[..., 0] > self.seen - 1 - self.window  # (B, G, m)
            mask = mask & inside.unsqueeze(2)  # (B, G, 1, m)
        self.steps += 1
        self.bytes_read += (self.k.valid().numel() + self.v.valid().numel()) * self.k.data.element_size()
        return KVView(self.k.valid(), self.v.valid(), selected=True, mask=mask,
                      scores=self if self.needs_probs else None)

    def _victims(self, cap: torch.Tensor) -> torch.Tensor:
        """(B, G) slot each (sequence, head) gives up: the lowest priority among its kept slots."""
        m = self.k.length
        pr = self.priority(self.pos.valid()[..., 0], self.score.valid()[..., 0], cap)
        slots = torch.arange(m, device=pr.device)
        pr = pr.masked_fill(slots >= self.kept.view(-1, 1, 1), float("inf"))
        return pr.argmin(-1)

    def _compact(self) -> None:
        """After the prefill: keep the cap_b highest-priority valid entries of each (sequence, head)."""
        self.compact_due = False
        cap = self._caps()
        pos = self.pos.valid()[..., 0]  # (B, G, n)
        pr = self.priority(pos, self.score.valid()[..., 0], cap)
        pr = pr.masked_fill(pos < self.first.view(-1, 1, 1), float("-inf"))  # padding is never kept
        k = int(cap.max())
        idx = pr.topk(k, dim=-1, sorted=True).indices  # (B, G, k): rows past cap_b are masked
        for buf in self.row_buffers():
            kept = buf.gather(idx)
            buf.reset()
            buf.append(kept)
        self.kept = cap.clone()

    def rows_for(self, tokens: int) -> int:
        """A budget's entries, windowed or not (entries the window has left stay, masked): all it is given."""
        return tokens

    # --- continuous batching: columns are slots here, so sequences join slot-aligned; padding shifts the
    # positions they hold ---------------------------------------------------------------------------

    def join(self, other: "EvictingLayer", at_self: int, at_other: int, room: int) -> None:
        for layer, at in ((self, at_self), (other, at_other)):
            if layer.compact_due:
                layer._compact()
            layer.pos.valid().add_(at)
        n_valid = torch.cat([self.n_valid, other.n_valid])
        slots = int(self.cache.entries(n_valid + room).max())  # the most any row will keep
        length = max(self.k.length, other.k.length)
        for a, b in zip(self.row_buffers(), other.row_buffers()):
            a.join(b, 0, 0, max(0, slots - length))
        self.kept, self.n_valid = torch.cat([self.kept, other.kept]), n_valid
        self.first = torch.cat([self.first + at_self, other.first + at_other])
        self.seen += at_self

    def retain(self, rows: list[int], trim: int, room: int) -> None:
        if self.compact_due:
            self._compact()
        index = torch.tensor(rows, device=self.kept.device)
        self.kept, self.n_valid, self.first = self.kept[index], self.n_valid[index], self.first[index] - trim
        slots = int(self.cache.entries(self.n_valid + room).max()) if rows else 0
        for buf in self.row_buffers():
            buf.retain(rows, 0, max(0, slots - buf.length))
        self.pos.valid().sub_(trim)
        self.seen -= trim

    def row_buffers(self) -> list:
        return [self.k, self.v, self.pos, self.score]

    def add_scores(self, probs: torch.Tensor) -> None:
        """Accumulate attention weights (B, G, m) of the kept slots (H2O)."""
        self.score.data[:, :, : probs.shape[-1], 0] += probs

    def get_seq_length(self) -> int:
        return self.seen if self.is_initialized else 0

    @property
    def nbytes(self) -> int:
        return (self.k.nbytes + self.v.nbytes) if self.is_initialized else 0


class EvictingCache(Rebatch):
    layer_class = EvictingLayer

    def __init__(self, model, budget: float = DEFAULT_BUDGET, min_budget: int = DEFAULT_MIN_BUDGET,
                 kv_dtype: str = "auto", **_):
        check_budget(budget)
        check_min_budget(min_budget)
        check_kv_dtype(kv_dtype)
        self.kv_dtype = kv_dtype  # the kept rows' storage (config.KV_DTYPES)
        self.budget, self.min_budget = budget, min_budget  # keep max(budget x seen, min_budget) entries
        self.arch = get_arch(model)
        super().__init__(layers=[self.layer_class(self, i) for i in range(model.config.n_layers)])

    def prefix_facts(self, model) -> None:
        """No prefix reuse: which entries survive depends on the whole prompt (its attention scores, its end)."""
        return None

    def entries(self, tokens):
        """Entries kept after `tokens` valid tokens (an int, or a tensor of counts per sequence)."""
        return budget_caps(tokens, self.budget, self.min_budget)

    def set_budget(self, budget: float) -> None:
        """A new budget, before the first decode step (the prefill keeps everything until then)."""
        if any(l.is_initialized and not l.compact_due for l in self.layers):
            raise RuntimeError(f"{self.method}: the budget is fixed once decoding has evicted entries")
        check_budget(budget)
        self.budget = budget

    def before_attention(self, layer_idx, x, step) -> list:
        """A prompt's forward, at layer 0: which of its positions are valid (padding excluded), (B, T) or None, for
        every layer's view (they keep the entries a policy ranks highest among those)."""
        if layer_idx != 0 or x.shape[1] == 1:
            return []
        mask = keep_source(self.arch, step, layer_idx)  # (not layer 0's window: keep_source)
        keep = valid_keys(mask, self.layers[0].get_seq_length() + x.shape[1])
        keep = keep[:, -x.shape[1]:] if keep is not None else None
        return [(i, keep) for i in range(len(self.layers))]

    @property
    def stats(self) -> dict:
        layers = [l for l in self.layers if l.is_initialized]
        kept = sum(int(l.kept.sum()) for l in layers)
        seen = sum(int(l.n_valid.sum()) for l in layers)
        steps = max((l.steps for l in layers), default=0)
        return {"fetched_fraction": kept / seen if seen else 1.0, "pool_bytes": sum(l.nbytes for l in layers),
                "decode_steps": steps, "kv_bytes_per_step": sum(l.bytes_read for l in layers) // max(steps, 1)}

