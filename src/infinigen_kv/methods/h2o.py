"""`h2o`: Heavy-Hitter Oracle (Zhang et al., 2023): the entries with the largest accumulated attention plus a
recent window, within the budget (half/half by default, `recent_ratio`); the lowest-scoring non-recent
entry is evicted for good. Scores are summed over the query heads sharing a KV head."""

from __future__ import annotations

import torch

from ..config import DEFAULT_BUDGET, DEFAULT_MIN_BUDGET
from ..model.attention import LONG_PAST
from .evicting import EvictingCache, EvictingLayer

# Prefill queries scored at a time: a (B, G, r, 64, n) block of scores is still in cache when the softmax and
# the column sums read it back (at 8k tokens 1.8x faster than 256 on the 2-core EPYC).
QUERY_CHUNK = 64
# kernel paths (model/backend.py) whose build has kernels/column_sums.cpp's AVX2 column sums
FLOAT32_SUMS_PATHS = ("avx512-bf16", "avx512", "avx2")


class H2OLayer(EvictingLayer):
    needs_probs = True

    def priority(self, positions, scores, cap):
        recent = (cap.float() * self.cache.recent_ratio).long()  # (B,)
        is_recent = positions >= (self.seen - recent).view(-1, 1, 1)
        return scores.masked_fill(is_recent, float("inf"))  # recent first, then heavy hitters

    @torch.no_grad()
    def add_prefill_scores(self, query, key, attention_mask, scaling, backend) -> None:
        """Accumulated attention of every prefill query (B, H, T, d) on every key (B, G, n, d)."""
        self.add_column_sums(self.prefill_column_sums(query, key, attention_mask, scaling, backend))

    def add_column_sums(self, sums) -> None:
        """sums (B, G, n): attention the first n keys received (a TeeCache computes them once for every H2O cache
        in it: the same prompt, keys and mask at every budget)."""
        self.score.data[:, :, : sums.shape[-1], 0] += sums

    def prefill_column_sums(self, query, key, attention_mask, scaling, backend) -> torch.Tensor:
        """The attention each key received from the chunk's queries, summed over a group's heads (B, G, n): a
        chunk of queries at a time, each over the keys it may see (causal: those up to its last query, half the
        work of all n; on a sliding-window layer only those from its first query's window on)."""
        B, H, T, d = query.shape
        G, n = key.shape[1], key.shape[2]
        if (sums := self._kernel_sums(query, key, attention_mask, scaling, backend)) is not None:
            return sums
        r = H // G
        q = (query.float() * scaling).reshape(B, G, r, T, d)
        kt = key.float().transpose(-1, -2)  # (B, G, d, n)
        total = torch.zeros(B, G, n, device=query.device)
        future = torch.ones(QUERY_CHUNK, QUERY_CHUNK, dtype=torch.bool, device=query.device).triu_(1)
        for i in range(0, T, QUERY_CHUNK):
            c = min(QUERY_CHUNK, T - i)
            end = n - T + i + c  # keys past the chunk's last query are masked for all of it
            lo = max(0, n - T + i - self.window + 1) if self.window else 0  # and those before its first's window
            s = torch.matmul(q[:, :, :, i : i + c].reshape(B, G, r * c, d), kt[..., lo:end])  # (B, G, r*c, end-lo)
            s = s.view(B, G, r, c, end - lo)
            if attention_mask is not None:  # padding, windows: the model's own mask
                s.masked_fill_(~attention_mask[:, :, i : i + c, lo:end].unsqueeze(1), float("-inf"))
                p = torch.softmax(s, dim=-1).nan_to_num_(0.0)  # fully masked (padding) rows: 0
            else:  # causal: only the chunk's own keys are masked (each query sees itself)
                s[..., end - c :].masked_fill_(future[:c, :c], float("-inf"))
                p = torch.softmax(s, dim=-1)
            total[..., lo:end] += p.sum(dim=(2, 3))
        return total

    def _kernel_sums(self, query, key, attention_mask, scaling, backend):
        """The column sums (B, G, n) by a CPU kernel where a chunk is over a past of LONG_PAST keys or more (there
        they are most of the chunk's cost: at 16k keys PyTorch's path takes 2-6x the chunk's attention) and causal
        (no window, and the mask, the model's for a chunk over a past, has the last query of every row see every
        key: nothing padded): in bfloat16 products (kernels/prefill.cpp) where the layer's attention runs in those,
        else in float32 products (kernels/column_sums.cpp, AVX2; ~3x PyTorch's float32 path at 16k keys). None
        elsewhere: PyTorch's path."""
        T, d, n = query.shape[2], query.shape[3], key.shape[2]
        if self.window or query.is_cuda or n - T < LONG_PAST or query.dtype != torch.float32:
            return None
        if attention_mask is not None and not bool(attention_mask[:, :, -1, :n].all()):
            return None
        if backend is None or backend.ops is None:
            return None
        if backend.bf16_attention and d % 64 == 0:
            kernel = backend.ops.prefill_column_sums
        elif backend.path in FLOAT32_SUMS_PATHS:
            kernel = backend.ops.column_sums
        else:
            return None
        return torch.stack([kernel(query[b].transpose(0, 1), key[b].contiguous(), float(scaling))
                            for b in range(query.shape[0])])


class H2OCache(EvictingCache):
    """`H2OCache(model, budget=0.1, recent_ratio=0.5)`."""

    method = "h2o"
    layer_class = H2OLayer

    def __init__(self, model, budget: float = DEFAULT_BUDGET, recent_ratio: float = 0.5, min_budget: int = DEFAULT_MIN_BUDGET,
                 kv_dtype: str = "auto", **_):
        if not 0.0 <= recent_ratio <= 1.0:
            raise ValueError(f"recent_ratio must be in [0, 1], got {recent_ratio}")
        self.recent_ratio = recent_ratio
        super().__init__(model, budget, min_budget, kv_dtype)
