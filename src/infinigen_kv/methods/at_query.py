"""What a selection of InfiniGen's pool that chooses at each layer's own decode query shares (quest.py,
shadowkv.py): no calibration, eager steps, its dense layers, the layer's past and cap, the step's valid past."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .infinigen.fetch import Fetch
from .infinigen.speculator import fetch_cap


class AtQuery:
    """A subclass writes `choose_at_query(cache, l, q, step)` (the layer's Fetch, or None: its whole past) and
    `reset()`; it sets `dense_layers` and `in_place`."""

    calibrated = False  # no offline step, no partial keys: its metadata is made from the pool's rows
    whole = False
    static = False  # its fetch follows the past: eager steps (no CUDA graph)
    dense_layers = 0

    def dense(self, cache, layer_idx: int) -> bool:
        """The first dense_layers, and a model's sliding-window layers (Gemma 3's local layers: a 512-token window
        attended whole)."""
        return layer_idx < self.dense_layers or cache.arch.local(layer_idx)

    def choose(self, cache, layer_idx: int, x: torch.Tensor, step) -> Iterator[tuple[int, Fetch]]:
        return iter(())  # nothing chosen one layer ahead: each layer at its own query

    @staticmethod
    def past(cache, layer_idx: int) -> tuple | None:
        """(the pool layer, its n past rows, the cap of its fetch), or None where nothing is left out (a dense or
        empty layer, a cap that holds the whole past)."""
        target = cache.layers[layer_idx]
        if not target.is_initialized or target.dense:
            return None
        n, c = target.k.length, cache.config
        cap = fetch_cap(n, cache.budget_of(layer_idx), c.max_num_kv, c.min_budget)
        return None if cap >= n else (target, n, cap)

    @staticmethod
    def past_keep(step, layer_idx: int, n: int) -> torch.Tensor | None:
        """(B, n) bool: the past positions the step's query may attend (padding out), once a step (the step's
        memo); None: all."""
        key = ("at-query-keep", step.windows[layer_idx], n)
        if key not in step.memo:
            mask = step.layer_mask(layer_idx)  # (B, 1, 1, n + 1) bool or None
            step.memo[key] = None if mask is None else mask[:, 0, 0, :n].contiguous()
        return step.memo[key]
