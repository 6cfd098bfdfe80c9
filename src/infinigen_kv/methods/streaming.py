"""`streaming`: StreamingLLM (Xiao et al., 2024): a few attention-sink tokens (each sequence's first ones)
plus the most recent tokens, within the budget; the oldest non-sink entry is evicted for good."""

from __future__ import annotations

from ..config import DEFAULT_BUDGET, DEFAULT_MIN_BUDGET
from .evicting import EvictingCache, EvictingLayer


class StreamingLayer(EvictingLayer):
    def priority(self, positions, scores, cap):
        sink = positions < (self.first.view(-1, 1, 1) + self.cache.sink_tokens)
        return positions.float().masked_fill(sink, float("inf"))  # newest first, sinks always


class StreamingCache(EvictingCache):
    """`StreamingCache(model, budget=0.1, sink_tokens=4)`."""

    method = "streaming"
    layer_class = StreamingLayer

    def __init__(self, model, budget: float = DEFAULT_BUDGET, sink_tokens: int = 4, min_budget: int = DEFAULT_MIN_BUDGET,
                 kv_dtype: str = "auto", **_):
        if sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {sink_tokens}")
        self.sink_tokens = sink_tokens
        super().__init__(model, budget, min_budget, kv_dtype)
