"""int5 rows: linear weights at 5 bits, as a GGUF's Q5_0, Q5_1 and Q5_K blocks hold them, in tiles of 16 rows.

A GGUF's Q5 tensors (most of a Q4_K_M file whose rows are no multiple of 256, as the 0.5B's 896) keep their 5-bit
levels here: requantized to int4 they cost the 0.5B 4% perplexity, held as int8 rows 1.5x the bytes a step reads.
A row of `in` values (a multiple of 32) is cut in groups of 32 as in int4 rows (int4_rows.py): x ~ d_g q + m_g with
q in [0, 31] and d_g, m_g float16 (Q5_0: m = -16 d; Q5_1: its own d and m; Q5_K: its super-block's d times the
group's 6-bit scale and dmin times its 6-bit minimum, each rounded once to float16). A row is its groups' low
nibbles as int4 rows hold them (in / 2 bytes), then 4 bytes of high bits a group, then the float16 scales, then the
minimums: (out, 3 in / 4) bytes, 6 bits a weight. A group's high-bit dword holds q[4c + j]'s fifth bit at bit c of
byte j and q[16 + 4c + j]'s at bit 4 + c (c, j in [0, 4)), so that a tile's chunk c gets its fifth bits with one
shift and one mask (kernels/linear.cpp, tile_dot_q).

Held, a weight is whole tiles of 16 rows (its out a multiple of 16; the loader holds others as int8 rows): group g
of a tile is 384 bytes, int4's four 64-byte chunks of low nibbles, then the 16 rows' high-bit dwords (64 bytes),
then their scales, then their minimums. The float8_e5m2 dtype tells these rows from int4 (uint8) and int8 rows
everywhere a weight's dtype chooses the path; no float8 arithmetic ever touches them (they are bytes).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .kernels import library
from . import int4_rows

GROUP = int4_rows.GROUP
TILE = int4_rows.TILE
DTYPE = torch.float8_e5m2  # the held rows' dtype: bytes, marked


def width(in_features: int) -> int:
    """Bytes of a stored row of `in_features` values."""
    if in_features % GROUP:
        raise ValueError(f"int5 rows need a multiple of {GROUP} values a row, not {in_features}")
    return in_features * 3 // 4


def dim(row_bytes: int) -> int:
    d = row_bytes * 4 // 3
    if width(d) != row_bytes:
        raise ValueError(f"{row_bytes} bytes is no int5 row's width")
    return d


def _bit_positions() -> torch.Tensor:
    """(32,): the bit of its group's high-bit dword that holds value v's fifth bit (see above)."""
    v = torch.arange(32)
    low = v < 16
    c, j = (v % 16) // 4, v % 4
    return 8 * j + c + torch.where(low, 0, 4)


_BITS = _bit_positions()


def from_levels(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Rows (..., width(in)) uint8 of levels q (..., in) in [0, 31], scales d and minimums m (..., in / 32) float16."""
    *lead, n = q.shape
    ng = n // GROUP
    qg = q.reshape(*lead, ng, GROUP)
    lo = qg & 0x0F
    packed = (lo[..., :16] | (lo[..., 16:] << 4)).reshape(*lead, n // 2)
    hb = ((qg >> 4) & 1).to(torch.int64) << _BITS.to(q.device)  # (..., ng, 32)
    dword = hb.sum(-1)  # (..., ng) int64: the fifth bits (the sum of distinct powers of two: an or)
    high = dword.contiguous().view(torch.uint8).view(*lead, ng, 8)[..., :4].reshape(*lead, 4 * ng)  # low 4 bytes
    return torch.cat([packed, high, d.contiguous().view(torch.uint8), m.contiguous().view(torch.uint8)], -1)


def pack_rows(x: torch.Tensor) -> torch.Tensor:
    """Values x (..., in) -> rows (..., width(in)) uint8, each group by its minimum and (max - min) / 31 (q5_1's
    rounding: `--weights int5` from a checkpoint's values)."""
    width(x.shape[-1])
    return from_levels(*int4_rows.group_levels(x, 31))


@lru_cache(maxsize=64)
def _tile_order(w: int) -> torch.Tensor:
    """(16 w,) int64: for each byte of a tile (see above), its index in the tile's 16 rows (16, w) flattened."""
    n = dim(w)
    ng = n // GROUP
    i = torch.arange(TILE * w).view(TILE, w)  # a row: ng x 16 level bytes, ng x 4 high bytes, ng x 2 d, ng x 2 m
    lv = i[:, : 16 * ng].reshape(TILE, ng, 4, 4).permute(1, 2, 0, 3)  # (group, chunk, row, 4 bytes)
    hb = i[:, 16 * ng : 20 * ng].reshape(TILE, ng, 4).permute(1, 0, 2)  # (group, row, 4 bytes)
    d = i[:, 20 * ng : 22 * ng].reshape(TILE, ng, 2).permute(1, 0, 2)
    m = i[:, 22 * ng :].reshape(TILE, ng, 2).permute(1, 0, 2)
    return torch.cat([lv.reshape(ng, 256), hb.reshape(ng, 64), d.reshape(ng, 32), m.reshape(ng, 32)], -1).reshape(-1)


def tiled(rows: torch.Tensor) -> torch.Tensor:
    """Rows (R, w) uint8, R a multiple of 16 -> the held form (R, w) in DTYPE."""
    if rows.shape[0] % TILE:
        raise ValueError(f"int5 rows are held in whole tiles of {TILE} rows, not {rows.shape[0]} rows")
    return int4_rows.tiled(rows, _tile_order).view(DTYPE)


def rows_of(held: torch.Tensor) -> torch.Tensor:
    """The held form (R, w) -> its rows (R, w) uint8."""
    return int4_rows.rows_of(held.view(torch.uint8), _tile_order)


def pack(x: torch.Tensor) -> torch.Tensor:
    """Values x (R, in) -> the held form."""
    return tiled(pack_rows(x))


def unpacked(held: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The held form (..., width(in)) -> the values it holds (..., in) in `dtype` (the CPU kernel where built, for
    float32 and bfloat16: the same bits)."""
    n = dim(held.shape[-1])
    if dtype in (torch.float32, torch.bfloat16) and (kern := library() if held.is_cpu else None) is not None:
        return kern.dequantize_q5_tiles(held.contiguous(), n, dtype == torch.bfloat16)
    return reference_unpacked(held, dtype)


def reference_unpacked(held: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """unpacked in PyTorch ops: level x scale + min, one fused multiply-add's bits (a 5-bit level times a float16
    scale is exact in float32: the sum is the one rounding)."""
    *lead, w = held.shape
    rows = rows_of(held.reshape(-1, w))
    n = dim(w)
    ng = n // GROUP
    packed = rows[:, : n // 2].reshape(-1, ng, 16)
    lo = torch.cat([packed & 0x0F, packed >> 4], -1).to(torch.int64)  # (R, ng, 32)
    dword = rows[:, n // 2 : n // 2 + 4 * ng].contiguous().view(torch.int32).to(torch.int64)  # (R, ng)
    high = (dword.unsqueeze(-1) >> _BITS.to(held.device)) & 1
    q = (lo | (high << 4)).float()
    d = rows[:, n // 2 + 4 * ng : n // 2 + 6 * ng].contiguous().view(torch.float16).float()
    m = rows[:, n // 2 + 6 * ng :].contiguous().view(torch.float16).float()
    return (q * d.unsqueeze(-1) + m.unsqueeze(-1)).reshape(*lead, n).to(dtype)
