"""A GGUF tensor's blocks into the forms the engine holds, rows at a time, with as few roundings as each allows.

`natural(kind)` is the form a block type is held in by default (the file's precision):

| GGUF type | held as | how |
|---|---|---|
| Q4_0, Q4_1 | int4 rows | levels, scale and minimum copied (Q4_0: m = -8 d), no rounding |
| Q4_K | int4 rows | levels copied; a group's scale d x sc and minimum -dmin x m rounded once to float16 |
| Q5_0, Q5_1 | int5 rows | levels, scale and minimum copied (Q5_0: m = -16 d), no rounding |
| Q5_K | int5 rows | levels copied; scale and minimum rounded once to float16, as Q4_K |
| Q8_0 | int8 rows | values and scales copied |
| Q6_K | int6 rows | the blocks as they lie (levels, int8 scales and d); int8 rows where its weight cannot be int6 tiles |
| others of 4 bits and more | int8 rows | values rounded once to int8 groups of 32 |
| types under 4 bits (Q2_K, Q3_K, IQ2, IQ3, IQ1) | int4 rows | values rounded once to q4_1 groups |
| F32, F16, BF16 | bfloat16 | values rounded to bfloat16 (BF16: as they are) |

`held_rows(tensor, data, form)` gives rows [0, n) of `data` (the tensor's bytes for those rows) in `form`: the rows
layout (int4_rows / int5_rows / int8_rows / Q6_K's blocks; the caller tiles them: int4_rows, int5_rows, int8_tiles,
int6_tiles), or "bfloat16" / "float32"
values. Where a form holds more bits than the type (Q4 into int5 or int8 rows, Q5_0 into int8 rows) the levels are
still copied; otherwise the values are dequantized (gguf.quants for the types not decoded here) and rounded once.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from . import int4_rows, int5_rows, int8_rows

# GGML block types (gguf.GGMLQuantizationType's values)
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
BF16 = 30
GROUP = 32
FORMS = ("int4", "int5", "int6", "int8", "bfloat16", "float32")  # fewest bits first: a merged weight takes its parts' last


def natural(kind: int) -> str:
    """The form a tensor of GGML type `kind` is held in at the file's precision (see the table above)."""
    if kind in (F32, F16, BF16):
        return "bfloat16"
    if kind in (Q4_0, Q4_1, Q4_K):
        return "int4"
    if kind in (Q5_0, Q5_1, Q5_K):
        return "int5"
    if kind == Q6_K:
        return "int6"
    if kind == Q8_0:
        return "int8"
    if kind in (Q2_K, Q3_K):
        return "int4"
    return "int4" if bits_per_weight(kind) < 4 else "int8"


def bits_per_weight(kind: int) -> float:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    return 8 * size / block


def rounding(kind: int, form: str) -> str:
    """What holding type `kind` in `form` rounds, in words (for the start-up line and the docs)."""
    if form == "float32":
        return "none"
    if form == "bfloat16":
        return "none" if kind == BF16 else "values to bfloat16"
    if _levels_fit(kind, form):
        return "none" if kind not in (Q4_K, Q5_K) else "scales to float16"
    return f"values to {form}"


def _levels_fit(kind: int, form: str) -> bool:
    """Whether `form` holds type `kind`'s levels as they are."""
    if form == "int6":
        return kind == Q6_K
    if form == "int8":
        return kind in (Q8_0, Q4_0, Q5_0)
    if form == "int5":
        return kind in (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K)
    return form == "int4" and kind in (Q4_0, Q4_1, Q4_K)


def held_rows(kind: int, data: bytes, n: int, cols: int, form: str) -> torch.Tensor:
    """Rows [0, n) of a tensor of type `kind` with `cols` columns, from their bytes `data`, in `form`: int4 / int5 /
    int8 rows (uint8 / uint8 / int8, untiled) or bfloat16 / float32 values (n, cols)."""
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if form == "int6":
        if kind != Q6_K:
            raise ValueError("int6 rows hold a GGUF's Q6_K blocks only")
        return raw.view(n, -1)
    if (kind, form) in ((Q4_0, "int4"), (Q4_1, "int4"), (Q5_0, "int5"), (Q5_1, "int5")):
        return _copied(kind, raw, n, cols)
    if form in ("int4", "int5") and _levels_fit(kind, form):
        q, d, m = levels(kind, raw, n, cols)
        return (int4_rows if form == "int4" else int5_rows).from_levels(q, d, m)
    if form == "int8" and kind == Q8_0:
        b = raw.view(n, cols // GROUP, 34)
        ints = b[..., 2:].reshape(n, cols).view(torch.int8)
        return torch.cat([ints, b[..., :2].reshape(n, -1).view(torch.int8)], -1)
    if form == "int8" and kind in (Q4_0, Q5_0):  # d (q - 8 | 16): the levels less their offset, exact in int8
        q, d, _ = levels(kind, raw, n, cols)
        offset = 8 if kind == Q4_0 else 16
        ints = (q.to(torch.int16) - offset).to(torch.int8)
        return torch.cat([ints, d.contiguous().view(torch.int8)], -1)
    x = values(kind, raw, n, cols)
    if form == "float32":
        return x
    if form == "bfloat16":
        return x.to(torch.bfloat16)
    if form == "int8":
        return int8_rows.pack_kv(x)
    return (int4_rows if form == "int4" else int5_rows).pack_rows(x)


def _copied(kind: int, raw: torch.Tensor, n: int, cols: int) -> torch.Tensor:
    """Q4_0 / Q4_1 blocks as int4 rows, Q5_0 / Q5_1 as int5 rows, their bytes moved: a block's 16 level bytes are a
    row's group as they are (byte j: q[j] | q[j + 16] << 4), its fifth bits (Q5: bit v of qh is q[v]'s) moved into the
    group's dword (int5_rows: q[4c + j]'s at bit 8j + c, q[16 + 4c + j]'s at 8j + 4 + c), its scale and minimum
    (Q4_0 / Q5_0: -8 d / -16 d, exact) after."""
    ng = cols // GROUP
    size = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24}[kind]
    b = raw.view(n, ng, size)
    d = b[..., :2]
    at = 4 if kind in (Q4_1, Q5_1) else 2
    if at == 4:
        m = b[..., 2:4]
    else:
        m = (d.contiguous().view(torch.float16).float() * -(8 if kind == Q4_0 else 16)).half().view(torch.uint8)
    parts = [b[..., at + 4 * (kind in (Q5_0, Q5_1)) :].reshape(n, ng * 16)]
    if kind in (Q5_0, Q5_1):  # each byte of qh (8 values' fifth bits) looked up as its bits of the dword
        qh = b[..., at : at + 4].to(torch.int64)  # (n, ng, 4)
        t = _fifth_bits_table()
        dword = t[0][qh[..., 0]] | t[1][qh[..., 1]] | t[2][qh[..., 2]] | t[3][qh[..., 3]]  # (n, ng)
        parts.append(dword.view(torch.uint8).view(n, ng, 8)[..., :4].reshape(n, ng * 4))  # (the low 4 bytes)
    return torch.cat(parts + [d.reshape(n, ng * 2), m.reshape(n, ng * 2)], -1)


@lru_cache(maxsize=1)
def _fifth_bits_table() -> torch.Tensor:
    """(4, 256) int64: for byte i of a Q5 block's qh (values 8i..8i+7's fifth bits) of each value, those bits where
    int5 rows' dword holds them."""
    x = torch.arange(256).view(1, 256, 1)
    k = torch.arange(8).view(1, 1, 8)
    where = int5_rows._BITS.view(4, 1, 8)  # value 8i + k's bit in the dword
    return (((x >> k) & 1) << where).sum(-1)  # (distinct powers of two: the sum is their or)


def values(kind: int, raw: torch.Tensor, n: int, cols: int) -> torch.Tensor:
    """(n, cols) float32: the values the blocks hold (gguf.quants' dequantize's bits)."""
    if kind == F32:
        return raw.view(torch.float32).view(n, cols).clone()
    if kind == F16:
        return raw.view(torch.float16).view(n, cols).float()
    if kind == BF16:
        return raw.view(torch.bfloat16).view(n, cols).float()
    if kind in (Q4_0, Q4_1, Q5_0, Q5_1):
        q, d, m = levels(kind, raw, n, cols)
        return (q.float().view(n, -1, GROUP) * d.float()[..., None] + m.float()[..., None]).view(n, cols)
    if kind == Q8_0:
        b = raw.view(n, cols // GROUP, 34)
        d = b[..., :2].contiguous().view(torch.float16).float()  # (n, groups, 1)
        return (b[..., 2:].contiguous().view(torch.int8).float() * d).view(n, cols)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    x = dequantize(raw.numpy(), GGMLQuantizationType(kind))
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).view(n, cols)


def levels(kind: int, raw: torch.Tensor, n: int, cols: int):
    """(q (n, cols) uint8 levels in each group's order, d and m (n, cols / 32) float16) with value = d q + m, of the
    Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K blocks in raw (uint8)."""
    if kind in (Q4_K, Q5_K):
        return _k_levels(kind, raw, n, cols)
    ng = cols // GROUP
    size = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24}[kind]
    b = raw.view(n * ng, size)
    d = b[:, :2].contiguous().view(torch.float16).view(n, ng)
    at = 2
    if kind in (Q4_1, Q5_1):
        m, at = b[:, 2:4].contiguous().view(torch.float16).view(n, ng), 4
    qh = None
    if kind in (Q5_0, Q5_1):
        qh, at = b[:, at : at + 4].contiguous().view(torch.int32).view(-1, 1), at + 4
    qs = b[:, at : at + 16]
    q = torch.cat([qs & 0x0F, qs >> 4], -1)  # (blocks, 32): value j's low bits
    if qh is not None:  # bit j of qh: value j's fifth bit
        bits = ((qh >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.uint8)
        q = q | (bits << 4)
    if kind in (Q4_0, Q5_0):
        m = (d.float() * -(8 if kind == Q4_0 else 16)).half()  # exact: a power of two times a float16
    return q.view(n, cols), d, m


def _scale_min_k4(s: torch.Tensor):
    """A K-quant super-block's 12 scale bytes (blocks, 12) -> 6-bit scales and minimums (blocks, 8) of its 8 groups."""
    s = s.to(torch.int32)
    lo_sc, lo_m = s[:, 0:4] & 63, s[:, 4:8] & 63
    hi_sc = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    hi_m = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], -1), torch.cat([lo_m, hi_m], -1)


def _k_levels(kind: int, raw: torch.Tensor, n: int, cols: int):
    """Q4_K / Q5_K super-blocks of 256 (8 groups of 32): levels copied; a group's scale d x sc and minimum
    -dmin x m (float32 products, exact) rounded to float16 once."""
    size = 144 if kind == Q4_K else 176
    nb = n * cols // 256
    b = raw.view(nb, size)
    d = b[:, 0:2].contiguous().view(torch.float16).float()  # (nb, 1)
    dmin = b[:, 2:4].contiguous().view(torch.float16).float()
    sc, mn = _scale_min_k4(b[:, 4:16])  # (nb, 8)
    qs = b[:, -128:].reshape(nb, 4, 32)  # chunk j: groups 2j (low nibbles) and 2j + 1 (high nibbles)
    q = torch.stack([qs & 0x0F, qs >> 4], 2).reshape(nb, 8, 32)
    if kind == Q5_K:  # qh[l]: bit 2j of value l of group 2j, bit 2j + 1 of group 2j + 1
        qh = b[:, 16:48].to(torch.int32)  # (nb, 32)
        bits = (qh[:, None, :] >> torch.arange(8, dtype=torch.int32)[None, :, None]) & 1
        q = q | (bits.to(torch.uint8) << 4)
    half_max = 65504.0
    dg = (d * sc).clamp(-half_max, half_max).half()
    mg = (-(dmin * mn)).clamp(-half_max, half_max).half()
    ng = cols // GROUP
    return q.reshape(n, cols), dg.reshape(n, ng), mg.reshape(n, ng)
