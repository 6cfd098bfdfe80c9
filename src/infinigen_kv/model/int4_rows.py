"""int4 rows: linear and embedding weights at 4 bits (`--weights int4`), in llama.cpp's q4_1 groups laid out as a row.

A row of `in` values (in a multiple of 32) is cut in groups of 32; group g holds x ~ d_g q + m_g with q in [0, 15],
d_g = (max - min) / 15 and m_g = min rounded to float16 (the q computed from the rounded d and m, so they read back
what they were divided by). Its 32 values take 16 bytes, byte j = q[j] | q[j + 16] << 4 (q4_1's order: a GGUF's Q4_1
and Q4_0 blocks are these bytes as they are); then the row's float16 scales d, then its float16 minimums m:
(out, in / 2 + 4 in / 32) uint8, 5 bits a weight. The uint8 dtype tells these rows from int8 rows (int8_rows.py)
everywhere a weight's dtype chooses the path.

Why q4_1's groups and not q4_0's or q4_K's: the minimum makes a group's 16 levels span its values rather than a
symmetric range around zero (q4_0 wastes a level and half a range on one-signed groups: measurably worse on small
models); groups of 32 with their own float16 scale and minimum read back a Q4_K super-block's sub-blocks within
float16's rounding, and a decode kernel's group is then one 32-byte vector of a row's activations (int8 for VNNI's
u8 x s8 products: the weight's levels are unsigned, the activations signed).
"""

from __future__ import annotations

import torch

from . import backend as backends

GROUP = 32


def width(in_features: int) -> int:
    """Bytes of a stored row of `in_features` values."""
    if in_features % GROUP:
        raise ValueError(f"int4 rows need a multiple of {GROUP} values a row, not {in_features}")
    return in_features // 2 + 4 * (in_features // GROUP)


def dim(row_bytes: int) -> int:
    """The `in_features` of a stored row `row_bytes` wide (width is linear: 0.625 bytes a value)."""
    d = row_bytes * 8 // 5
    if width(d) != row_bytes:
        raise ValueError(f"{row_bytes} bytes is no int4 row's width")
    return d


def pack(x: torch.Tensor) -> torch.Tensor:
    """Values x (..., in) -> stored rows (..., width(in)) uint8, in PyTorch ops (once, at load)."""
    *lead, n = x.shape
    width(n)
    xg = x.float().reshape(*lead, n // GROUP, GROUP)
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    m = lo.half()
    d = ((hi - m.float()) / 15).half()
    df, mf = d.float(), m.float()
    q = torch.where(df > 0, (xg - mf) / df, 0.0).round_().clamp_(0, 15).to(torch.uint8)  # (..., groups, 32)
    packed = q[..., :16] | (q[..., 16:] << 4)  # (..., groups, 16)
    scales = d.view(*lead, -1).view(torch.uint8)  # float16 bytes, little-endian
    mins = m.view(*lead, -1).view(torch.uint8)
    return torch.cat([packed.reshape(*lead, n // 2), scales, mins], -1)


def unpacked(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored rows (..., width(in)) uint8 -> the values they hold (..., in) in `dtype` (the CPU kernel where
    built, for float32 and bfloat16: the same bits)."""
    *lead, w = rows.shape
    n = dim(w)
    if dtype in (torch.float32, torch.bfloat16) and (kern := backends.for_device(rows.device).ops) is not None:
        return kern.dequantize_q4_rows(rows.contiguous(), n, dtype == torch.bfloat16)
    return reference_unpacked(rows, dtype)


def reference_unpacked(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """unpacked in PyTorch ops."""
    *lead, w = rows.shape
    n = dim(w)
    ng = n // GROUP
    packed = rows[..., : n // 2].reshape(*lead, ng, 16)
    q = torch.cat([packed & 0x0F, packed >> 4], -1).float()  # (..., groups, 32)
    d = rows[..., n // 2 : n // 2 + 2 * ng].contiguous().view(torch.float16).float()  # (..., groups)
    m = rows[..., n // 2 + 2 * ng :].contiguous().view(torch.float16).float()
    return (q * d.unsqueeze(-1) + m.unsqueeze(-1)).reshape(*lead, n).to(dtype)
