"""The Triton kernel of gather_rows.py (imported on a GPU, where PyTorch's CUDA wheels bring Triton; on CPU the
tests run it with TRITON_INTERPRET=1)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

ROWS = 16  # rows a program copies at a time
# Programs in all, about half the GPU's SMs: each waits on the link (a few microseconds a load), so a few dozen
# already keep ~0.5 MB in flight, more than the link needs; a program for every ROWS rows (thousands) would fill
# every SM's warp slots and stall the compute stream's kernels that the gather is meant to run beside.
SM_SHARE = 0.5


@functools.lru_cache(maxsize=None)
def _programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # Triton's interpreter: a few, so that its tests loop over blocks as a GPU does
    return max(1, int(torch.cuda.get_device_properties(device).multi_processor_count * SM_SHARE))


@triton.jit
def _gather(pk, pv, idx, wk, wv, spk_b, spk_g, spk_t, spv_b, spv_g, spv_t, si_b, si_g, si_t,
            swk_b, swk_g, swk_t, swv_b, swv_g, swv_t, G, M, DK: tl.constexpr, DV: tl.constexpr,
            BK: tl.constexpr, BV: tl.constexpr, ROWS: tl.constexpr, STEP: tl.constexpr):
    """Program (row = b * G + g, p): blocks p, p + STEP, ... of ROWS slots j each, K and V rows idx[b, g, j] of the
    pool to slot 1 + j of the working set, whole rows at a time."""
    row = tl.program_id(0)
    b = row // G
    g = row % G
    kk = tl.arange(0, BK)
    vv = tl.arange(0, BV)
    for block in range(tl.program_id(1), tl.cdiv(M, ROWS), STEP):
        jj = block * ROWS + tl.arange(0, ROWS)
        ok = jj < M
        t = tl.load(idx + b * si_b + g * si_g + jj * si_t, mask=ok, other=0)  # (ROWS,) pool positions
        mk = ok[:, None] & (kk[None, :] < DK)
        x = tl.load(pk + b * spk_b + g * spk_g + t[:, None] * spk_t + kk[None, :], mask=mk)
        mv = ok[:, None] & (vv[None, :] < DV)
        y = tl.load(pv + b * spv_b + g * spv_g + t[:, None] * spv_t + vv[None, :], mask=mv)
        tl.store(wk + b * swk_b + g * swk_g + (1 + jj)[:, None] * swk_t + kk[None, :], x.to(wk.dtype.element_ty),
                 mask=mk)
        tl.store(wv + b * swv_b + g * swv_g + (1 + jj)[:, None] * swv_t + vv[None, :], y.to(wv.dtype.element_ty),
                 mask=mv)


def as_words(t: torch.Tensor) -> torch.Tensor:
    """Rows of bytes viewed as 8-byte words where their width and strides allow: int8 rows (136 bytes
    at d = 128) have no 16-byte-divisible stride for Triton to vectorize on, so each lane would read the pinned pool
    one byte at a time across the link (18.8 GB/s measured for int8 rows on an H100 against 55 for bfloat16's
    256-byte rows); as words each lane reads 8 bytes."""
    if t.element_size() >= 8 or (t.shape[-1] * t.element_size()) % 8 or t.data_ptr() % 8:
        return t
    if any((s * t.element_size()) % 8 for s in t.stride()[:-1]):
        return t
    return t.view(torch.int64)


def triton_gather(pool_k, pool_v, idx, ws_k, ws_v) -> None:
    """gather_rows's op as one kernel launch (see gather_rows.py for the shapes)."""
    if pool_k.dtype == ws_k.dtype and pool_v.dtype == ws_v.dtype and pool_k.element_size() == 1:  # copied bytes
        words = [as_words(t) for t in (pool_k, pool_v, ws_k, ws_v)]
        if all(w.dtype == torch.int64 for w in words):
            pool_k, pool_v, ws_k, ws_v = words
    B, G, m = idx.shape
    dk, dv = pool_k.shape[-1], pool_v.shape[-1]
    if any(t.stride(-1) != 1 for t in (pool_k, pool_v, ws_k, ws_v)):
        raise ValueError("the row gather reads and writes rows contiguous in their last dim")
    s = [t.stride()[:3] for t in (pool_k, pool_v, idx, ws_k, ws_v)]
    # (B * G, step) programs, about _programs() in all, each looping over its share of the m / ROWS blocks
    step = max(1, min(triton.cdiv(m, ROWS), triton.cdiv(_programs(idx.device), B * G)))
    _gather[(B * G, step)](pool_k, pool_v, idx, ws_k, ws_v, *s[0], *s[1], *s[2], *s[3], *s[4], G, m, DK=dk, DV=dv,
                           BK=triton.next_power_of_2(dk), BV=triton.next_power_of_2(dv), ROWS=ROWS, STEP=step)
