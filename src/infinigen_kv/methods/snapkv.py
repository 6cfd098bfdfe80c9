"""`snapkv`: SnapKV (Li et al., 2024). The prompt's last `window` queries (the observation window) vote: each KV
head's prompt entries are scored by the attention those queries give them (softmax over the prompt, summed over the
window's queries and the group's query heads), smoothed by an average pool of `kernel` positions (a kept entry
brings its neighbours: the paper's clustering), and each (sequence, KV head) keeps its top entries within the budget
and the window itself. Decode tokens are kept; once the budget binds, the lowest-voted prompt entry goes first.

An evicting cache (methods/evicting.py): the vote is taken at the prefill (the prompt's last chunk holds the
window: a chunk shorter than it votes with its own queries), and decode steps attend as the other evicting caches
do, with no scores. Exact at budget 1.0 (every entry kept).
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import DEFAULT_BUDGET, DEFAULT_MIN_BUDGET
from .evicting import EvictingCache, EvictingLayer


class SnapKVLayer(EvictingLayer):
    needs_probs = True  # the prefill's attention reaches add_prefill_scores
    prompt = 0  # the prompt's length once voted (its window is its last `window` positions)

    def view(self, key_states, value_states, fetch=None):
        view = super().view(key_states, value_states, fetch)
        if key_states.shape[2] == 1:  # a decode step votes nothing: attention without explicit weights
            return dataclasses.replace(view, scores=None)
        return view

    def priority(self, positions, scores, cap):
        """The window's vote; the window and every decode token first."""
        return scores.masked_fill(positions >= self.prompt - self.cache.window, float("inf"))

    @torch.no_grad()
    def add_prefill_scores(self, query, key, attention_mask, scaling, backend) -> None:
        self.add_column_sums(self.prefill_column_sums(query, key, attention_mask, scaling, backend))

    def add_column_sums(self, sums) -> None:
        """The vote of the chunk's window (B, G, n): the latest chunk's replaces an earlier one's (the last chunk
        of a prompt holds its window)."""
        self.score.data[:, :, :, 0].zero_()
        self.score.data[:, :, : sums.shape[-1], 0] = sums
        self.prompt = sums.shape[-1]

    def prefill_column_sums(self, query, key, attention_mask, scaling, backend=None) -> torch.Tensor:
        """query (B, H, T, d) of a prompt chunk over its keys (B, G, n, d): the attention of its last `window`
        queries, summed over them and each group's heads, average-pooled over `kernel` positions: (B, G, n)."""
        B, H, T, d = query.shape
        G, n = key.shape[1], key.shape[2]
        w = min(self.cache.window, T)
        q = (query[:, :, -w:].float() * scaling).reshape(B, G, H // G * w, d)
        s = (q @ key.float().transpose(-1, -2)).view(B, G, H // G, w, n)
        if attention_mask is not None:  # padding, windows: the model's mask of the window's rows
            s = s.masked_fill(~attention_mask[:, :, -w:, :n].unsqueeze(1), float("-inf"))
        else:  # causal: query i of the window sees the keys up to its own position
            future = torch.ones(w, w, dtype=torch.bool, device=query.device).triu_(1)
            s[..., n - w :] = s[..., n - w :].masked_fill(future, float("-inf"))
        votes = torch.softmax(s, dim=-1).nan_to_num_(0.0).sum(dim=(2, 3))  # (B, G, n)
        k = self.cache.kernel
        if k > 1:
            votes = torch.nn.functional.avg_pool1d(votes.view(B * G, 1, n), k, stride=1, padding=k // 2,
                                                   count_include_pad=False).view(B, G, -1)[..., :n]
        return votes


class SnapKVCache(EvictingCache):
    """`SnapKVCache(model, budget=0.1, window=32, kernel=5)`: at most max(budget x seen, min_budget) entries a
    (sequence, KV head, layer): the prompt's observation window and the entries it votes for."""

    method = "snapkv"
    layer_class = SnapKVLayer

    def __init__(self, model, budget: float = DEFAULT_BUDGET, window: int = 32, kernel: int = 5,
                 min_budget: int = DEFAULT_MIN_BUDGET, kv_dtype: str = "auto", **_):
        if window < 1 or kernel < 1 or kernel % 2 == 0:
            raise ValueError(f"snapkv: window >= 1 and an odd kernel >= 1, got {window}, {kernel}")
        self.window, self.kernel = window, kernel
        super().__init__(model, budget, min_budget, kv_dtype)
