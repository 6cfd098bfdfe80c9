"""int8 tiles: linear and LM-head weights in int8 rows (llama.cpp's q8_0 groups, model/int8_rows.py's K/V row layout:
`in` values, then their groups' float16 scales), held 16 rows to a tile as int4 and int5 weights are.

A decode step reads an int8 row with one horizontal sum per row and group; a tile's group (544 bytes) holds the 16
rows' values 4c..4c+3 in chunk c (bytes 4o..4o+3: row o's), then their scales, so one 512-bit dpbusd of a chunk with
four activations broadcast is a step of 16 rows' dot products, one row a lane (kernels/linear.cpp, tile_dot_q8):
measured on the 0.5B's LM head 22 GB/s in rows, the memory's rate in tiles. The tile's bytes are the rows' bytes
moved, none changed (`rows_of` gives them back exactly), so a GGUF's Q8_0 blocks are held as they are. A weight's
first 16 floor(out / 16) rows are tiles, the rest rows; rows of `in` not a multiple of 32 stay int8 rows (torch.int8).
The float8_e4m3fn dtype tells tiles from rows everywhere a weight's dtype chooses the path; no float8 arithmetic
ever touches them (they are bytes). An embedding table that is also the LM head is looked up through `rows_at`.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from . import int4_rows, int8_rows
from .kernels import library

GROUP = int8_rows.GROUP
TILE = int4_rows.TILE
DTYPE = torch.float8_e4m3fn  # the held tiles' dtype: bytes, marked


def fits(in_features: int) -> bool:
    """Whether weights of `in_features` inputs are held as tiles (whole groups of 32), else as int8 rows."""
    return in_features % GROUP == 0


@lru_cache(maxsize=64)
def _tile_order(w: int) -> torch.Tensor:
    """(16 w,) int64: for each byte of a tile (see above), its index in the tile's 16 rows (16, w) flattened."""
    n = int8_rows.kv_dim(w)
    ng = n // GROUP
    i = torch.arange(TILE * w).view(TILE, w)  # a row: ng x 32 value bytes, then ng x 2 scale bytes
    values = i[:, :n].reshape(TILE, ng, 8, 4).permute(1, 2, 0, 3)  # (group, chunk, row, 4 bytes)
    d = i[:, n:].reshape(TILE, ng, 2).permute(1, 0, 2)  # (group, row, 2 bytes)
    return torch.cat([values.reshape(ng, 512), d.reshape(ng, 32)], -1).reshape(-1)


@lru_cache(maxsize=64)
def _row_order(w: int) -> torch.Tensor:
    """(16, w) int64: row o of a tile, byte j -> that byte's offset in the tile (tiled's inverse, a row at a time)."""
    where = torch.empty(TILE * w, dtype=torch.int64)
    where[_tile_order(w)] = torch.arange(TILE * w)
    return where.view(TILE, w)


def tiled(rows: torch.Tensor) -> torch.Tensor:
    """int8 rows (R, kv_width(in)) -> the held form (R, kv_width(in)) in DTYPE: the first 16 floor(R / 16) in tiles."""
    if not fits(int8_rows.kv_dim(rows.shape[-1])):
        raise ValueError(f"int8 tiles need whole groups of {GROUP} values a row")
    return int4_rows.tiled(rows.view(torch.int8), _tile_order).view(DTYPE)


def rows_of(held: torch.Tensor) -> torch.Tensor:
    """The held form (R, w) -> its rows (R, w) int8 (tiled's inverse)."""
    return int4_rows.rows_of(held.view(torch.int8), _tile_order)


def rows_at(held: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (any shape) of the held form (R, w) -> (*ids.shape, w) int8 rows: an embedding's lookups, each row's
    bytes read from its tile (one gather; no other row's bytes unpacked)."""
    R, w = held.shape
    flat = held.view(torch.int8).reshape(-1)
    ids = ids.to(held.device, torch.int64)
    tile_rows = R // TILE * TILE
    start = torch.where(ids < tile_rows, ids - ids % TILE, ids) * w  # (...,) a tile's (or a trailing row's) first byte
    order = _row_order(w).to(held.device)
    offsets = torch.where((ids < tile_rows).unsqueeze(-1), order[ids % TILE], torch.arange(w, device=held.device))
    return flat[start.unsqueeze(-1) + offsets]


def pack(x: torch.Tensor) -> torch.Tensor:
    """Values x (R, in) -> the held form: q8_0 rows (int8_rows.pack_kv), tiled."""
    return tiled(int8_rows.pack_kv(x.float()))


def unpacked(held: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The held form (..., kv_width(in)) -> the values it holds (..., in) in `dtype` (the CPU kernel where built, for
    float32 and bfloat16: int8_rows.unpacked_kv's bits)."""
    n = int8_rows.kv_dim(held.shape[-1])
    if dtype in (torch.float32, torch.bfloat16) and (kern := library() if held.is_cpu else None) is not None:
        return kern.dequantize_q8_tiles(held.contiguous(), n, dtype == torch.bfloat16)
    return int8_rows.unpacked_kv(rows_of(held), dtype)
