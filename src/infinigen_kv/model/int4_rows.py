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

Held, a weight's rows go in tiles of 16 (`tiled`: its first 16 floor(out / 16) rows, the rest stay rows; the same
bytes, moved): group g of a tile is 320 bytes, four 64-byte chunks (chunk c: bytes 4o..4o+3 hold row o's levels
q[4c..4c+3] in their low nibbles, q[16+4c..16+4c+3] in their high ones), then the 16 rows' scales, then their
minimums. A decode kernel's 512-bit product of a chunk with four activations broadcast is then one step of 16 rows'
dot products, one row a lane: in rows each (row, group) cost a conversion, a permute and a multiply-add of its own,
~2.5x the instructions a row of activations (instruction-bound at 4 rows, where tiles read at the memory's rate).
Slices of whole tiles are tiles (a merged weight's parts: `part`).
"""

from __future__ import annotations

import torch

from .kernels import library

GROUP = 32
TILE = 16  # rows a tile


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
    """Values x (..., in) -> the held form (..., width(in)) uint8: rows (pack_rows) in tiles (tiled)."""
    return tiled(pack_rows(x))


def pack_rows(x: torch.Tensor) -> torch.Tensor:
    """Values x (..., in) -> rows (..., width(in)) uint8 in q4_1's groups, in PyTorch ops (once, at load)."""
    width(x.shape[-1])
    return from_levels(*group_levels(x, 15))


def group_levels(x: torch.Tensor, top: int):
    """Values x (..., in) -> (levels (..., in) uint8 in [0, top], scales d and minimums m (..., in / 32) float16) of
    groups of 32 by their minimum and (max - min) / top, the levels computed from the rounded d and m (so that they
    read back what they were divided by)."""
    *lead, n = x.shape
    xg = x.float().reshape(*lead, n // GROUP, GROUP)
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    m = lo.half()
    d = ((hi - m.float()) / top).half()
    df, mf = d.float(), m.float()
    q = torch.where(df > 0, (xg - mf) / df, 0.0).round_().clamp_(0, top).to(torch.uint8)  # (..., groups, 32)
    return q.reshape(*lead, n), d.squeeze(-1), m.squeeze(-1)


def _tile_order(w: int) -> torch.Tensor:
    """(16 w,) int64: for each byte of a tile (see above), its index in the tile's 16 rows (16, w) flattened."""
    ng = dim(w) // GROUP
    i = torch.arange(TILE * w).view(TILE, w)  # a row: ng x 16 level bytes, ng x 2 scale bytes, ng x 2 minimum bytes
    lv = i[:, : 16 * ng].reshape(TILE, ng, 4, 4).permute(1, 2, 0, 3)  # (group, chunk, row, 4 bytes)
    d = i[:, 16 * ng : 18 * ng].reshape(TILE, ng, 2).permute(1, 0, 2)  # (group, row, 2 bytes)
    m = i[:, 18 * ng :].reshape(TILE, ng, 2).permute(1, 0, 2)
    return torch.cat([lv.reshape(ng, 256), d.reshape(ng, 32), m.reshape(ng, 32)], -1).reshape(-1)


def tiled(rows: torch.Tensor, order=None) -> torch.Tensor:
    """Rows (..., w) -> the held form (..., w): the leading dims' first 16 floor(R / 16) rows in tiles (see above).
    order(w): a tile's byte order (int5 rows pass theirs)."""
    w = rows.shape[-1]
    flat = rows.reshape(-1, w)
    T = flat.shape[0] // TILE
    tiles = flat[: T * TILE].reshape(T, TILE * w)[:, (order or _tile_order)(w)].view(T * TILE, w)
    return torch.cat([tiles, flat[T * TILE :]]).view(rows.shape)


def rows_of(held: torch.Tensor, order=None) -> torch.Tensor:
    """The held form (..., w) -> its rows (..., w) (tiled's inverse)."""
    w = held.shape[-1]
    flat = held.reshape(-1, w)
    T = flat.shape[0] // TILE
    head = torch.empty(T, TILE * w, dtype=held.dtype, device=held.device)
    head[:, (order or _tile_order)(w)] = flat[: T * TILE].reshape(T, TILE * w)
    return torch.cat([head.view(T * TILE, w), flat[T * TILE :]]).view(held.shape)


def part(held: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """Rows [start, start + size) of a held weight (out, w) in the held form: a view where they are whole tiles (or
    run to the end), else a copy re-tiled (int4 rows; int5 rows are whole tiles by construction)."""
    out = held.shape[0]
    if start % TILE == 0 and (size % TILE == 0 or start + size == out):
        return held[start : start + size]
    if held.dtype != torch.uint8:
        raise ValueError(f"rows [{start}, {start + size}) of a weight held in tiles are not whole tiles")
    return tiled(rows_of(held)[start : start + size])


def from_levels(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Rows (..., width(in)) uint8 of levels q (..., in) in [0, 15] (a group's 32 in order), scales d and minimums m
    (..., in / 32) float16: a GGUF's Q4_0, Q4_1 and Q4_K blocks as they are (their levels moved, not re-rounded)."""
    *lead, n = q.shape
    qg = q.reshape(*lead, n // GROUP, GROUP)
    packed = qg[..., :16] | (qg[..., 16:] << 4)
    scales, mins = d.contiguous().view(torch.uint8), m.contiguous().view(torch.uint8)
    return torch.cat([packed.reshape(*lead, n // 2), scales, mins], -1)


def unpacked(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A held weight (..., width(in)) uint8 (tiles, then rows) -> the values it holds (..., in) in `dtype` (the CPU
    kernel where built, for float32 and bfloat16: the same bits)."""
    *lead, w = rows.shape
    n = dim(w)
    if dtype in (torch.float32, torch.bfloat16) and (kern := library() if rows.is_cpu else None) is not None:
        return kern.dequantize_q4_rows(rows.contiguous(), n, dtype == torch.bfloat16)
    return reference_unpacked(rows, dtype)


def reference_unpacked(held: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """unpacked in PyTorch ops."""
    rows = rows_of(held)
    *lead, w = rows.shape
    n = dim(w)
    ng = n // GROUP
    packed = rows[..., : n // 2].reshape(*lead, ng, 16)
    q = torch.cat([packed & 0x0F, packed >> 4], -1).float()  # (..., groups, 32)
    d = rows[..., n // 2 : n // 2 + 2 * ng].contiguous().view(torch.float16).float()  # (..., groups)
    m = rows[..., n // 2 + 2 * ng :].contiguous().view(torch.float16).float()
    return (q * d.unsqueeze(-1) + m.unsqueeze(-1)).reshape(*lead, n).to(dtype)
