"""The operations our model classes (transformer.py) run, on weights as they are held: float32, bfloat16 (weight-only,
float32 compute on CPU), int8 tiles (model/int8_tiles.py, llama.cpp's q8_0 groups), int5 or int4 tiles. The path is chosen per call from
the input's shape, the weight's dtype and the backend passed in (model/backend.py; None: PyTorch's ops), never from
state set elsewhere:

- a few rows (a decode step of a batch) on CPU: the `linear` kernel, one streamed read of each weight row for every
  row of x (held weights up to SMALL_BATCH rows, float32 up to KERNEL_ROWS; then W x^T up to SMALL_BATCH); a
  bfloat16 weight in bfloat16 products where the CPU has them (kernels/bf16_dots.h), as a prompt chunk's;
- a prompt chunk (`prefill=True`): the BLAS in blocks of exactly PREFILL_ROWS rows (the last padded), so a row gets
  the same bits at any row count and batch; a held weight multiplies in bfloat16 where the CPU does so natively
  (`bf16_linear`), else it is converted to float32 in slices (`converted_linear`), each slice once for all the
  blocks; int4, int5 and int8 tiles take the `linear` kernel's integer products instead where the backend says
  (`int_prefill`: 512-bit VNNI, where they beat the bfloat16 GEMM), each row's bits its own at any row count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import int4_rows, int5_rows, int6_tiles, int8_rows, int8_tiles

PREFILL_ROWS = 128  # a prompt chunk's rows a CPU GEMM call: MKL's sgemm picks its blocking by the row count (at 1,536
# inputs a row's bits at 57 rows or more differ from its bits at 16), never by a row's place among them; at 128 rows
# a 512-row chunk's products take 1.03-1.12x the time of one call (64 rows: 1.3-1.5x)
SMALL_BATCH = 32  # rows up to which W x^T beats x W^T (measured: batch 2-32), and the kernel a held weight
KERNEL_ROWS = 8  # rows up to which the `linear` kernel beats the BLAS on float32 weights
CONVERT_ELEMENTS = 1 << 22  # most weight elements converted to float32 at once: 16 MB, under the heap's mapping threshold (heap.py: larger temporaries are mapped and faulted in afresh at every call)


def dense(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values of a weight as held, in `dtype`: int8 rows and int8, int5 and int4 tiles dequantized, others
    converted."""
    if w.dtype == torch.int8:
        return int8_rows.unpacked_kv(w, dtype)
    if w.dtype == int8_tiles.DTYPE:
        return int8_tiles.unpacked(w, dtype)
    if w.dtype == int6_tiles.DTYPE:
        return int6_tiles.unpacked(w, dtype)
    if w.dtype == int5_rows.DTYPE:
        return int5_rows.unpacked(w, dtype)
    return int4_rows.unpacked(w, dtype) if w.dtype == torch.uint8 else w.to(dtype)


def tiled(w: torch.Tensor) -> bool:
    """Whether a held weight keeps its rows in tiles of 16 (int4, int5, int6 and int8 tiles): slices of it are
    whole tiles."""
    return w.dtype in TILED


TILED = (torch.uint8, int5_rows.DTYPE, int6_tiles.DTYPE, int8_tiles.DTYPE)


def part(w: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """Rows [start, start + size) of a held weight in its held form: a view where they are whole tiles (or run to the
    end), else a copy re-tiled (int4 and int8 tiles; int5 and int6 weights are whole tiles by construction)."""
    if not tiled(w) or (start % int4_rows.TILE == 0 and (size % int4_rows.TILE == 0 or start + size == w.shape[0])):
        return w[start : start + size]
    if w.dtype == int8_tiles.DTYPE:
        return int8_tiles.tiled(int8_tiles.rows_of(w)[start : start + size])
    return int4_rows.part(w, start, size)


def rows(w: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `index` of a held weight w, their values in `dtype` (a tiled weight's through its values)."""
    if w.dtype == int8_tiles.DTYPE:
        return int8_rows.unpacked_kv(int8_tiles.rows_at(w, index), dtype)
    return dense(w, dtype)[index.to(w.device)] if tiled(w) else dense(w[index.to(w.device)], dtype)


def converted_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, blocks: int = 0) -> torch.Tensor:
    """F.linear of x with w as held: converted to x's dtype for the call in slices of its output rows where it is
    large (never a float32 copy of a whole LM head). blocks: x (rows, in) multiplied `blocks` rows a GEMM call (rows
    a multiple of it), each slice of w converted once for all of them."""
    step = w.shape[0] if w.dtype == x.dtype else max(
        int4_rows.TILE, CONVERT_ELEMENTS // w.shape[1] // int4_rows.TILE * int4_rows.TILE)  # whole tiles
    if blocks:  # each block's rows of each slice written where they go: no copy of the whole output joined
        y = x.new_empty(x.shape[0], w.shape[0])
        for s in range(0, w.shape[0], step):
            wp = w[s : s + step] if w.dtype == x.dtype else dense(w[s : s + step], x.dtype)
            for r in range(0, x.shape[0], blocks):
                part = torch.mm(x[r : r + blocks], wp.t())
                y[r : r + blocks, s : s + step] = part if bias is None else part.add_(bias[s : s + step])
        return y
    parts = []
    for s in range(0, w.shape[0], step):
        wp = w[s : s + step] if w.dtype == x.dtype else dense(w[s : s + step], x.dtype)
        parts.append(F.linear(x, wp, None if bias is None else bias[s : s + step]))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _prefill_linear(x2: torch.Tensor, w: torch.Tensor, bias, backend, bf16: bool = True) -> torch.Tensor:
    """x2 (rows, in) of a prompt chunk by the BLAS, on CPU in GEMM calls of exactly PREFILL_ROWS rows (the last
    padded with zeros): the BLAS chooses its blocking (and so a row's bits) by the rows of a call, so a prompt alone
    and in a batch, or cut in other chunks, would differ. A weight held in bfloat16 or int8 rows multiplies in
    bfloat16 where the CPU does so natively (backend.bf16_products) unless `bf16` is False."""
    rows = x2.shape[0]
    if not x2.is_cpu:
        return converted_linear(x2, w, bias)
    if (bf16 and w.dtype in TILED and backend is not None and backend.int_prefill
            and x2.dtype == torch.float32):  # each row alone: no blocks, no padding
        return backend.ops.linear(x2.contiguous(), w, bias, None, False)
    if rows % PREFILL_ROWS:
        padded = x2.new_zeros(-(-rows // PREFILL_ROWS) * PREFILL_ROWS, x2.shape[1])
        padded[:rows] = x2
        return _prefill_linear(padded, w, bias, backend, bf16)[:rows]
    if bf16 and w.dtype != x2.dtype and x2.dtype == torch.float32 and backend is not None and backend.bf16_products:
        return bf16_linear(x2, w, bias)
    return converted_linear(x2, w, bias, PREFILL_ROWS)


def bf16_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (rows, in) float32 @ w^T in bfloat16 products (oneDNN, float32 accumulation), w as held (bfloat16, or int8,
    int5 or int4 values in bfloat16, a slice at a time), PREFILL_ROWS rows a call -> (rows, out) float32: x and the product
    rounded to bfloat16 (a relative error of ~2e-3 a value, the order of the bfloat16 weights' own rounding)."""
    y = converted_linear(x.to(torch.bfloat16), w, None, PREFILL_ROWS).float()
    return y + bias if bias is not None else y


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, backend, prefill: bool = False,
           residual: torch.Tensor | None = None, bf16: bool = True) -> torch.Tensor:
    """x (..., in) @ w^T + bias (+ residual, shaped as the output): w (out, in) as held (float32, bfloat16, int8
    rows or tiles); backend: the model's (None: PyTorch's ops). prefill: x is a prompt chunk (the BLAS path whatever its rows); otherwise a decode step's few rows take
    the kernel where it reads the weight faster than the BLAS. Runs ~120 times a decode step: the kernel's case
    is checked first, with as few tensor calls as it needs. A weight held in bfloat16 multiplies x rounded to
    bfloat16 where the CPU does so natively (backend.bf16_products), a prompt chunk's and a decode step's alike;
    bf16=False keeps float32 products (the LM head: logits a client scores)."""
    if not prefill and x.is_cpu and x.dtype == torch.float32:
        shape = x.shape
        rows = x.numel() // shape[-1]
        kern = backend.ops if backend is not None else None
        if kern is not None and 0 < rows <= (SMALL_BATCH if w.dtype != torch.float32 else KERNEL_ROWS):
            x2 = x.view(rows, shape[-1]) if x.is_contiguous() else x.reshape(rows, shape[-1]).contiguous()
            products = bf16 and backend.bf16_products  # (a bfloat16 weight's only)
            if residual is None:
                return kern.linear(x2, w, bias, None, products).view(*shape[:-1], -1)
            return kern.linear(x2, w, bias, residual.view(rows, -1), products).view(*shape[:-1], -1)
    return _linear(x, w, bias, backend, prefill, residual, bf16)


def _linear(x, w, bias, backend, prefill, residual, bf16=True) -> torch.Tensor:
    """linear's BLAS paths: a prompt chunk (in blocks of PREFILL_ROWS rows), W x^T for a few rows of float32 weights,
    or the weight converted for the call."""
    shape = x.shape[:-1]
    rows = x.numel() // x.shape[-1]
    if rows == 0:
        return x.new_empty(*shape, w.shape[0])
    x2 = x.reshape(rows, x.shape[-1])
    if prefill:
        y = _prefill_linear(x2, w, bias, backend, bf16)
    elif x.is_cpu and 2 <= rows <= SMALL_BATCH and w.dtype == x.dtype:
        y = torch.mm(w, x2.t()).t()
        y = y + bias if bias is not None else y
    else:
        y = converted_linear(x2, w, bias)
    y = y.view(*shape, -1)
    return y + residual if residual is not None else y


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, backend, plus_one: bool = False) -> torch.Tensor:
    """x / rms(x) * w over the last dim in float32 (plus_one: * (1 + w), Gemma), in x's dtype. A float32 x on CPU
    (Llama's form) is one kernel call where the backend has the kernels, the same bits."""
    if (not plus_one and x.dtype == torch.float32 and backend is not None and backend.ops is not None
            and x.is_cpu):
        return backend.ops.rms_norm(x.contiguous(), w, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if plus_one:
        return (h * (1.0 + w.float())).to(x.dtype)
    return w * h.to(x.dtype)


def embedding(ids: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of the embedding table w (as held: float32, bfloat16, int8 rows or tiles, int4 rows) for ids, in
    `dtype`."""
    if w.dtype == int8_tiles.DTYPE:  # (a table that is also the LM head)
        return int8_rows.unpacked_kv(int8_tiles.rows_at(w, ids), dtype)
    return dense(F.embedding(ids, w), dtype)


def held(w: torch.Tensor, weights: str | None) -> torch.Tensor:
    """A float weight in the form `weights` names: None (as given), "bfloat16", "int8" (tiles where its rows are
    whole groups, else rows), "int5" or "int4" (tiles)."""
    if weights == "bfloat16":
        return w.to(torch.bfloat16)
    if weights == "int8":
        if w.dtype in (torch.int8, int8_tiles.DTYPE):
            return w
        return int8_tiles.pack(w) if int8_tiles.fits(w.shape[-1]) else int8_rows.pack_kv(w.float())
    if weights == "int4":
        return w if w.dtype == torch.uint8 else int4_rows.pack(w.float())
    if weights == "int5":
        return w if w.dtype == int5_rows.DTYPE else int5_rows.pack(w.float())
    if weights == "int6" and w.dtype != int6_tiles.DTYPE:
        raise ValueError("int6 weights are a GGUF's Q6_K blocks as they lie; values are held as int8 instead")
    return w


def held_dtype(in_features: int, weights: str | None, dtype: torch.dtype) -> torch.dtype:
    """The dtype of a weight of `in_features` inputs held as `weights` (None: `dtype`, the model's)."""
    if weights == "int8":
        return int8_tiles.DTYPE if int8_tiles.fits(in_features) else torch.int8
    return {"bfloat16": torch.bfloat16, "int6": int6_tiles.DTYPE, "int5": int5_rows.DTYPE, "int4": torch.uint8}.get(
        weights, dtype)


def held_width(in_features: int, weights: str | None) -> int:
    """Columns a held weight of `in_features` inputs takes (int8 and int4 rows end with their scales)."""
    if weights == "int4":
        return int4_rows.width(in_features)
    if weights == "int5":
        return int5_rows.width(in_features)
    if weights == "int6":
        return int6_tiles.width(in_features)
    return int8_rows.kv_width(in_features) if weights == "int8" else in_features
