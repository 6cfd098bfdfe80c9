"""int8 partial keys (`partial_dtype="int8"`): the row layout, the quantizer and the scores in PyTorch.

A stored row is the p partial channels quantized symmetrically by the row's absmax / 127, then that float32
scale's 4 bytes: (..., p + 4) int8. A row carries its own scale, so every row operation of the pool (append, put,
join, retain, fork, gather) moves both without knowing. The query is quantized the same way, per head; a score
is (q8 . k8) x k scale x q scale. The integer dot products are exact in float32 too (|sum| < 2^24 for p <= 1024),
so this PyTorch path and the CPU kernel (`quantize_rows`, `speculate` on int8 rows) give the same bits.
"""

from __future__ import annotations

import torch

from ...model import backend as backends


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., p) float32 -> (integer values (..., p) in float32, scale (..., 1) float32): x ~ values x scale."""
    scale = x.abs().amax(-1, keepdim=True) / 127
    values = torch.where(scale > 0, x / scale, 0.0).round_().clamp_(-127, 127)
    return values, scale


def pack(x: torch.Tensor) -> torch.Tensor:
    """Partial keys x (..., p) -> stored rows (..., p + 4) int8 (the CPU kernel where it serves, else PyTorch)."""
    x = x.float()
    kern = backends.for_device(x.device).ops
    if kern is not None:
        return kern.quantize_rows(x.contiguous())
    values, scale = quantize(x)
    return torch.cat([values.to(torch.int8), scale.contiguous().view(torch.int8)], -1)


def unpack(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored rows (..., p + 4) int8 -> (values (..., p) float32, scale (...) float32)."""
    p = rows.shape[-1] - 4
    return rows[..., :p].float(), rows[..., p:].contiguous().view(torch.float32).squeeze(-1)


def scores(q: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Approximate logits (B, G, r, n) float32 of the partial queries q (B, G, r, p) over int8 rows (B, G, n, p + 4)."""
    qv, sq = quantize(q.float() * scale)  # (B, G, r, p), (B, G, r, 1)
    kv, sk = unpack(rows)  # (B, G, n, p), (B, G, n)
    return torch.matmul(qv, kv.transpose(-1, -2)) * sk.unsqueeze(2) * sq
