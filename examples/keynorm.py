"""A KV-cache method written outside infinigen-kv: key-norm eviction (as kvpress's KnormPress scores a key: keys of
low L2 norm draw the most attention, so the entries with the largest key norms are the first evicted), with the
first `sinks` tokens of each sequence always kept. It subclasses the package's evicting layer (methods/evicting.py),
so the budget, its floor, the prefill, batching and the server come with it; the policy is one method, `priority`.

Use it from Python:

    import infinigen_kv as ig, keynorm
    ig.register_method("keynorm", keynorm.METHOD)
    out = ig.generate(model, ids, cache=ig.make_cache("keynorm", model, budget=0.1))

or install it (an entry point in the group "infinigen_kv.methods", see examples/pyproject.toml) and every command
takes it by name: `infinigen generate --method keynorm`, `bench accuracy --methods full,keynorm`, `serve --method
keynorm`.
"""

from __future__ import annotations

import torch

from infinigen_kv.config import DEFAULT_BUDGET, DEFAULT_MIN_BUDGET
from infinigen_kv.methods.evicting import EvictingCache, EvictingLayer
from infinigen_kv.methods.registry import Method
from infinigen_kv.model.kv import from_rows


class KeyNormLayer(EvictingLayer):
    def priority(self, positions: torch.Tensor, scores: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
        """Higher = kept: minus each kept key's L2 norm; the sinks first. positions (B, G, m) -> (B, G, m)."""
        keys = from_rows(self.k.valid()[:, :, : positions.shape[-1]], torch.float32)  # (B, G, m, d), as stored
        sink = positions < (self.first.view(-1, 1, 1) + self.cache.sinks)
        return (-keys.norm(dim=-1)).masked_fill(sink, float("inf"))


class KeyNormCache(EvictingCache):
    """`KeyNormCache(model, budget=0.1, sinks=4)`: at most max(budget x seen, min_budget) entries a (sequence, KV
    head, layer), those of the smallest key norms and the first `sinks` tokens."""

    method = "keynorm"
    layer_class = KeyNormLayer

    def __init__(self, model, budget: float = DEFAULT_BUDGET, sinks: int = 4, min_budget: int = DEFAULT_MIN_BUDGET,
                 kv_dtype: str = "auto"):
        if sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {sinks}")
        self.sinks = sinks
        super().__init__(model, budget, min_budget, kv_dtype)


# What the registry needs: its factory and traits (it decodes under a budget, so `bench accuracy` sweeps budgets;
# its prefill is the full cache's, so a bench prefills once for it and the others).
METHOD = Method("keynorm", KeyNormCache, frozenset({"budget", "min_budget", "kv_dtype", "sinks"}), takes_budget=True,
                shares_prefill=True)
