"""int6 tiles: a GGUF's Q6_K weights at their own 6.5625 bits, in tiles of 16 rows (a Q4_K_M file's LM head and half
its down projections; a Q6_K file's every layer).

A Q6_K super-block holds 256 values as d x sc_i x (q - 32): q in [0, 63] (four low bits and two high ones), sc_i an
int8 scale per 16 values, d a float16 per 256. Held as int8 rows they took 8.5 bits (1.3x the bytes a step reads);
here the same levels, scales and d, moved, none rounded. `rows` are the file's blocks as they lie (210 bytes per
256 values); `tiled` lays 16 rows out for the `linear` kernel (kernels/weight_rows.h): per super-block the 16 rows'
d (32 bytes), then per group of 32 values int4 tiles' four chunks of low nibbles (chunk c: bytes 4o..4o+3 hold row
o's q[4c..4c+3] and q[16+4c..16+4c+3]), two 64-byte vectors of high bits (row o's dword: byte j, bits 2c, 2c+1:
q[4c+j]'s in the first, q[16+4c+j]'s in the second) and the rows' two int8 scales (16 bytes each). A group's exact
integer sum of sc (q - 32) x is then scaled by d once. Only whole tiles (out a multiple of 16) and rows of whole
super-blocks (in a multiple of 256); the loader holds others as int8 rows. float8_e5m2fnuz marks the dtype (bytes).
"""

from __future__ import annotations

import torch

from .kernels import library

DTYPE = torch.float8_e5m2fnuz  # the held tiles' dtype: bytes, marked
TILE, GROUP, BLOCK, BLOCK_BYTES = 16, 32, 256, 210


def fits(rows: int, in_features: int) -> bool:
    """Whether a weight (rows, in_features) is held as int6 tiles: whole tiles of whole super-blocks."""
    return rows % TILE == 0 and in_features % BLOCK == 0


def width(in_features: int) -> int:
    """Bytes of a row of `in_features` values (Q6_K's: 210 a super-block)."""
    if in_features % BLOCK:
        raise ValueError(f"int6 rows need a multiple of {BLOCK} values a row, not {in_features}")
    return in_features // BLOCK * BLOCK_BYTES


def dim(row_bytes: int) -> int:
    if row_bytes % BLOCK_BYTES:
        raise ValueError(f"{row_bytes} bytes is no int6 row's width")
    return row_bytes // BLOCK_BYTES * BLOCK


def levels(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K rows (n, width) uint8 -> (q (n, in) uint8 in [0, 63], sc (n, in / 16) int8, d (n, in / 256) float16),
    value i = d[i // 256] x sc[i // 16] x (q[i] - 32) (llama.cpp's block: ql[128], qh[64], scales[16], d)."""
    n = rows.shape[0]
    b = rows.reshape(n, -1, BLOCK_BYTES)
    ql, qh = b[..., :128].reshape(n, -1, 2, 64), b[..., 128:192].reshape(n, -1, 2, 32)  # two halves of 128 values
    sc = b[..., 192:208].contiguous().view(torch.int8).reshape(n, -1)
    d = b[..., 208:].contiguous().view(torch.float16).reshape(n, -1)
    lo = torch.stack([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], 3)
    hi = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], 3)  # (n, blocks, half, 4 quarters, 32)
    q = (lo | (hi << 4)).reshape(n, -1)
    return q, sc, d


def tiled(rows: torch.Tensor) -> torch.Tensor:
    """Q6_K rows (R, width) uint8, R a multiple of 16 -> the held form (R, width) in DTYPE."""
    R, w = rows.shape
    if R % TILE:
        raise ValueError(f"int6 rows are held in whole tiles of {TILE} rows, not {R} rows")
    n = dim(w)
    q, sc, d = levels(rows)
    T, nb = R // TILE, n // BLOCK
    qg = q.view(T, TILE, nb, 8, 2, 4, 4)  # (tile, row, block, group, half, chunk, j)
    nib = (qg[..., 0, :, :] & 15) | ((qg[..., 1, :, :] & 15) << 4)  # (T, row, nb, 8, chunk, j)
    nib = nib.permute(0, 2, 3, 4, 1, 5).reshape(T, nb, 8, 256)  # chunk, row, j
    shifts = (2 * torch.arange(4, dtype=torch.uint8)).view(4, 1)  # chunk c's bits at 2c
    high = ((qg >> 4) << shifts).sum(-2, dtype=torch.uint8)  # (T, row, nb, 8, half, j): a byte's four chunks' bits
    high = high.permute(0, 2, 3, 4, 1, 5).reshape(T, nb, 8, 128)  # half, row, j
    scg = sc.view(T, TILE, nb, 8, 2).permute(0, 2, 3, 4, 1).reshape(T, nb, 8, 32).view(torch.uint8)
    groups = torch.cat([nib, high, scg], -1).reshape(T, nb, 8 * 416)
    dd = d.view(T, TILE, nb).permute(0, 2, 1).contiguous().view(torch.uint8).reshape(T, nb, 32)
    return torch.cat([dd, groups], -1).reshape(R, w).view(DTYPE)


def unpacked(held: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The held form (R, width(in)) -> the values it holds (R, in) in `dtype` (the CPU kernel where built, for
    float32 and bfloat16: the same bits), each (d x sc) x (q - 32) rounded once, as llama.cpp computes it."""
    n = dim(held.shape[-1])
    if dtype in (torch.float32, torch.bfloat16) and (kern := library() if held.is_cpu else None) is not None:
        return kern.dequantize_q6_tiles(held.contiguous(), n, dtype == torch.bfloat16)
    return reference_unpacked(held, dtype)


def reference_unpacked(held: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """unpacked in PyTorch ops, from the tiles' bytes."""
    R, w = held.shape
    n = dim(w)
    T, nb = R // TILE, n // BLOCK
    t = held.view(torch.uint8).reshape(T, nb, 32 + 8 * 416)
    d = t[..., :32].contiguous().view(torch.float16).float()  # (T, nb, 16 rows)
    g = t[..., 32:].reshape(T, nb, 8, 416)
    nib = g[..., :256].reshape(T, nb, 8, 4, TILE, 4)  # chunk, row, j
    high = g[..., 256:384].reshape(T, nb, 8, 2, TILE, 4)  # half, row, j
    sc = g[..., 384:].contiguous().view(torch.int8).reshape(T, nb, 8, 2, TILE).float()
    shifts = (2 * torch.arange(4, dtype=torch.uint8)).view(4, 1, 1)
    q = torch.stack([nib & 15, nib >> 4], 3)  # (T, nb, 8, half, chunk, row, j)
    q = q | (((high.unsqueeze(4) >> shifts) & 3) << 4)
    q = q.permute(0, 5, 1, 2, 3, 4, 6).float() - 32  # (T, row, nb, 8, half, chunk, j)
    scale = (d.permute(0, 2, 1).reshape(T, TILE, nb, 1, 1) * sc.permute(0, 4, 1, 2, 3))  # (T, row, nb, 8, half)
    return (scale[..., None, None] * q).reshape(R, n).to(dtype)
