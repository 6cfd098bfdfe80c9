"""int8 partial keys (`partial_dtype="int8"`): the scores in PyTorch over rows stored as model/int8_rows.py stores
them (the p partial channels, then the row's float32 scale). The query is quantized the same way, per head; a score
is (q8 . k8) x k scale x q scale. The integer dot products are exact in float32 too (|sum| < 2^24 for p <= 1024),
so this PyTorch path and the CPU kernel (`quantize_rows`, `speculate` on int8 rows) give the same bits.
"""

from __future__ import annotations

import torch

from ...model.int8_rows import quantize, unpack


def scores(q: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Approximate logits (B, G, r, n) float32 of the partial queries q (B, G, r, p) over int8 rows (B, G, n, p + 4)."""
    qv, sq = quantize(q.float() * scale)  # (B, G, r, p), (B, G, r, 1)
    kv, sk = unpack(rows)  # (B, G, n, p), (B, G, n)
    return torch.matmul(qv, kv.transpose(-1, -2)) * sk.unsqueeze(2) * sq
