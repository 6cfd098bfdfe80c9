"""The Triton kernel of gather_rows.py (imported on a GPU, where PyTorch's CUDA wheels bring Triton; on CPU the
tests run it with TRITON_INTERPRET=1)."""

from __future__ import annotations

import triton
import triton.language as tl

ROWS = 16  # rows a program copies: (B * G, m / ROWS) programs, enough loads in flight over the link


@triton.jit
def _gather(pk, pv, idx, wk, wv, spk_b, spk_g, spk_t, spv_b, spv_g, spv_t, si_b, si_g, si_t,
            swk_b, swk_g, swk_t, swv_b, swv_g, swv_t, G, M, DK: tl.constexpr, DV: tl.constexpr,
            BK: tl.constexpr, BV: tl.constexpr, ROWS: tl.constexpr):
    """Program (row = b * G + g, block): slots j of that block, K and V rows idx[b, g, j] of the pool to slot 1 + j
    of the working set, whole rows at a time."""
    row = tl.program_id(0)
    b = row // G
    g = row % G
    jj = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    ok = jj < M
    t = tl.load(idx + b * si_b + g * si_g + jj * si_t, mask=ok, other=0)  # (ROWS,) pool positions
    kk = tl.arange(0, BK)
    mk = ok[:, None] & (kk[None, :] < DK)
    x = tl.load(pk + b * spk_b + g * spk_g + t[:, None] * spk_t + kk[None, :], mask=mk)
    tl.store(wk + b * swk_b + g * swk_g + (1 + jj)[:, None] * swk_t + kk[None, :], x.to(wk.dtype.element_ty), mask=mk)
    vv = tl.arange(0, BV)
    mv = ok[:, None] & (vv[None, :] < DV)
    y = tl.load(pv + b * spv_b + g * spv_g + t[:, None] * spv_t + vv[None, :], mask=mv)
    tl.store(wv + b * swv_b + g * swv_g + (1 + jj)[:, None] * swv_t + vv[None, :], y.to(wv.dtype.element_ty), mask=mv)


def triton_gather(pool_k, pool_v, idx, ws_k, ws_v) -> None:
    """gather_rows's op as one kernel launch (see gather_rows.py for the shapes)."""
    B, G, m = idx.shape
    dk, dv = pool_k.shape[-1], pool_v.shape[-1]
    if any(t.stride(-1) != 1 for t in (pool_k, pool_v, ws_k, ws_v)):
        raise ValueError("the row gather reads and writes rows contiguous in their last dim")
    s = [t.stride()[:3] for t in (pool_k, pool_v, idx, ws_k, ws_v)]
    _gather[(B * G, triton.cdiv(m, ROWS))](pool_k, pool_v, idx, ws_k, ws_v, *s[0], *s[1], *s[2], *s[3], *s[4], G, m,
                                           DK=dk, DV=dv, BK=triton.next_power_of_2(dk),
                                           BV=triton.next_power_of_2(dv), ROWS=ROWS)
