"""int8 rows: how K/V rows (`kv_dtype="int8"`) and InfiniGen's partial keys are stored in int8. A row carries its
own scales, so every row operation of a buffer (append, put, join, retain, fork, gather, a copy to another device)
moves both without knowing. The CPU kernels (`quantize_rows`, `quantize_kv_rows`) and this PyTorch path give the
same bits.

- Partial keys (`pack`): the p values quantized symmetrically by the row's absmax / 127, then that float32 scale's 4
  bytes: (..., p + 4). One scale a row, so a score is an integer dot product times two scales.
- K/V rows (`pack_kv`): llama.cpp's q8_0 in a row: the d values in groups of 32 (the last may be shorter), each by
  its absmax / 127 rounded to float16 (the values are divided by the scale they are read back with), then the
  groups' float16 scales: (..., d + 2 ceil(d / 32)), 68 bytes for d = 64 as q8_0. One scale a row over 256 values
  cost Gemma 3 0.9% perplexity, groups of 32 0.19% (docs/BENCHMARKS.md, "K/V rows in int8").
"""

from __future__ import annotations

import torch

from .kernels import library


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., w) float32 -> (integer values (..., w) in float32, scale (..., 1) float32): x ~ values x scale."""
    scale = x.abs().amax(-1, keepdim=True) / 127
    values = torch.where(scale > 0, x / scale, 0.0).round_().clamp_(-127, 127)
    return values, scale


def pack(x: torch.Tensor) -> torch.Tensor:
    """Rows x (..., w) -> stored rows (..., w + 4) int8 (the CPU kernel where it serves, else PyTorch)."""
    x = x.float()
    kern = library() if x.is_cpu else None  # (the same bits either way)
    if kern is not None:
        return kern.quantize_rows(x.contiguous())
    values, scale = quantize(x)
    return torch.cat([values.to(torch.int8), scale.contiguous().view(torch.int8)], -1)


def unpack(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored rows (..., w + 4) int8 -> (values (..., w) float32, scale (...) float32)."""
    w = rows.shape[-1] - 4
    return rows[..., :w].float(), rows[..., w:].contiguous().view(torch.float32).squeeze(-1)


GROUP = 32  # K/V values a float16 scale


def kv_width(d: int) -> int:
    """Bytes of a stored K/V row of d values."""
    return d + 2 * -(-d // GROUP)


def kv_dim(width: int) -> int:
    """The d of a stored K/V row `width` bytes wide (kv_width is strictly increasing)."""
    d = max(0, (width - 2) * GROUP // (GROUP + 2) - 1)  # at most kv_width's; the first d reaching width is it
    while kv_width(d) < width:
        d += 1
    if kv_width(d) != width:
        raise ValueError(f"{width} bytes is no int8 K/V row's width")
    return d


def pack_kv(x: torch.Tensor) -> torch.Tensor:
    """K/V values x (..., d) -> stored rows (..., kv_width(d)) int8 (the CPU kernel where it serves, else PyTorch)."""
    x = x.float()
    kern = library() if x.is_cpu else None  # (the same bits either way)
    if kern is not None:
        return kern.quantize_kv_rows(x.contiguous())
    *lead, d = x.shape
    pad = -d % GROUP
    xg = torch.nn.functional.pad(x, (0, pad)).view(*lead, -1, GROUP)  # (..., groups, 32), zeros past d
    scale = (xg.abs().amax(-1, keepdim=True) / 127).clamp_(max=65504).half()
    sf = scale.float()
    values = torch.where(sf > 0, xg / sf, 0.0).round_().clamp_(-127, 127).to(torch.int8).view(*lead, -1)[..., :d]
    return torch.cat([values, scale.view(*lead, -1).view(torch.int8)], -1)


def unpacked_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored K/V rows (..., kv_width(d)) int8 -> the values they hold (..., d) in `dtype`."""
    *lead, w = rows.shape
    d = kv_dim(w)
    kern = library() if rows.is_cpu else None  # (the same bits either way)
    if kern is not None:  # (float32 values, then rounded to dtype: the PyTorch path's bits)
        out = kern.dequantize_kv_rows(rows.contiguous(), d)
        return out if dtype == torch.float32 else out.to(dtype)
    scale = rows[..., d:].contiguous().view(torch.float16).float()  # (..., groups)
    values = torch.nn.functional.pad(rows[..., :d].float(), (0, -d % GROUP)).view(*lead, -1, GROUP)
    out = (values * scale.unsqueeze(-1)).view(*lead, -1)[..., :d]
    return out.to(dtype).contiguous()  # (SDPA's CPU kernel blocks strided keys otherwise: other bits at other lengths)
