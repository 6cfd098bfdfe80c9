"""int8 rows: how K/V rows (`kv_dtype="int8"`) and InfiniGen's partial keys are stored in int8.

A stored row is its w values quantized symmetrically by the row's absmax / 127, then that float32 scale's 4 bytes:
(..., w + 4) int8. A row carries its own scale, so every row operation of a buffer (append, put, join, retain,
fork, gather, a copy to another device) moves both without knowing. For a head of 64 values that is 68 bytes, the
bytes of llama.cpp's q8_0 (two blocks of 32 values and a 16-bit scale each); one scale a row measured as accurate
(docs/BENCHMARKS.md, "K/V rows in int8"). The CPU kernel (`quantize_rows`) and this PyTorch path give the same bits.
"""

from __future__ import annotations

import torch

from . import backend as backends


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., w) float32 -> (integer values (..., w) in float32, scale (..., 1) float32): x ~ values x scale."""
    scale = x.abs().amax(-1, keepdim=True) / 127
    values = torch.where(scale > 0, x / scale, 0.0).round_().clamp_(-127, 127)
    return values, scale


def pack(x: torch.Tensor) -> torch.Tensor:
    """Rows x (..., w) -> stored rows (..., w + 4) int8 (the CPU kernel where it serves, else PyTorch)."""
    x = x.float()
    kern = backends.for_device(x.device).ops
    if kern is not None:
        return kern.quantize_rows(x.contiguous())
    values, scale = quantize(x)
    return torch.cat([values.to(torch.int8), scale.contiguous().view(torch.int8)], -1)


def unpack(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored rows (..., w + 4) int8 -> (values (..., w) float32, scale (...) float32)."""
    w = rows.shape[-1] - 4
    return rows[..., :w].float(), rows[..., w:].contiguous().view(torch.float32).squeeze(-1)


def unpacked(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows (..., w + 4) int8 -> the values they hold (..., w) in `dtype`."""
    values, scale = unpack(rows)
    return (values * scale.unsqueeze(-1)).to(dtype)
