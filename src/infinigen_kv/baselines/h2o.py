"""`h2o`: Heavy-Hitter Oracle (Zhang et al., 2023): the entries with the largest accumulated attention plus a
recent window, within the budget (half/half by default, `recent_ratio`); the lowest-scoring non-recent
entry is evicted for good. Scores are summed over the query heads sharing a KV head."""

from __future__ import annotations

import torch

from ..config import DEFAULT_BUDGET
from .evicting import EvictingCache, EvictingLayer

QUERY_CHUNK = 256  # prefill queries scored at a time: bounds the (B, G, r, chunk, n) score tensor


class H2OLayer(EvictingLayer):
    needs_probs = True

    def priority(self, positions, scores, cap):
        recent = (cap.float() * self.cache.recent_ratio).long()  # (B,)
        is_recent = positions >= (self.seen - recent).view(-1, 1, 1)
        return scores.masked_fill(is_recent, float("inf"))  # recent first, then heavy hitters

    @torch.no_grad()
    def add_prefill_scores(self, query, key, attention_mask, scaling) -> None:
        """Accumulated attention of every prefill query on every key: column sums, chunked."""
        B, H, T, d = query.shape
        G, n = key.shape[1], key.shape[2]
        q = query.reshape(B, G, H // G, T, d)
        total = torch.zeros(B, G, n, device=query.device)
        cols = torch.arange(n, device=query.device)
        for i in range(0, T, QUERY_CHUNK):
            qc = q[:, :, :, i : i + QUERY_CHUNK]  # (B, G, r, c, d)
            s = torch.matmul(qc.float(), key.float().unsqueeze(2).transpose(-1, -2)) * scaling  # (B, G, r, c, n)
            if attention_mask is not None:
                allowed = attention_mask[:, :, i : i + QUERY_CHUNK].unsqueeze(1)  # (B, 1, 1, c, n)
            else:
                rows = torch.arange(i, i + qc.shape[3], device=query.device) + (n - T)
                allowed = (cols <= rows.view(-1, 1)).view(1, 1, 1, -1, n)
            s = s.masked_fill(~allowed, float("-inf"))
            total += torch.softmax(s, dim=-1).nan_to_num_(0.0).sum(dim=(2, 3))  # fully masked rows: 0
        self.score.data[:, :, :n, 0] += total


class H2OCache(EvictingCache):
    """`H2OCache(model, budget=0.1, recent_ratio=0.5)`."""

    method = "h2o"
    layer_class = H2OLayer

    def __init__(self, model, budget: float = DEFAULT_BUDGET, recent_ratio: float = 0.5, **_):
        if not 0.0 <= recent_ratio <= 1.0:
            raise ValueError(f"recent_ratio must be in [0, 1], got {recent_ratio}")
        self.recent_ratio = recent_ratio
        super().__init__(model, budget)
