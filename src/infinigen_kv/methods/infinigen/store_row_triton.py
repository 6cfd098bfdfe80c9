"""The Triton kernel of store_row.py (imported on a GPU, where PyTorch's CUDA wheels bring Triton; on CPU the tests
run it with TRITON_INTERPRET=1)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _store_row(k, v, pk, pv, at, wk, wv, part, ch,
               sk_b, sk_g, sv_b, sv_g, spk_b, spk_g, spk_t, spv_b, spv_g, spv_t,
               swk_b, swk_g, swv_b, swv_g, spa_b, spa_g, spa_t, sch_g,
               G, DK: tl.constexpr, DV: tl.constexpr, P: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr, BP: tl.constexpr):
    """One program per (sequence, KV head): its K and V row to the pool at column `at` and to working-set slot 0,
    its raw channels ch[g] of K to the partial key cache at `at`."""
    row = tl.program_id(0)
    b, g = row // G, row % G
    t = tl.load(at)
    ok = tl.arange(0, BK)
    x = tl.load(k + b * sk_b + g * sk_g + ok, mask=ok < DK)
    tl.store(pk + b * spk_b + g * spk_g + t * spk_t + ok, x.to(pk.dtype.element_ty), mask=ok < DK)
    tl.store(wk + b * swk_b + g * swk_g + ok, x.to(wk.dtype.element_ty), mask=ok < DK)
    ov = tl.arange(0, BV)
    y = tl.load(v + b * sv_b + g * sv_g + ov, mask=ov < DV)
    tl.store(pv + b * spv_b + g * spv_g + t * spv_t + ov, y.to(pv.dtype.element_ty), mask=ov < DV)
    tl.store(wv + b * swv_b + g * swv_g + ov, y.to(wv.dtype.element_ty), mask=ov < DV)
    if P > 0:
        op = tl.arange(0, BP)
        c = tl.load(ch + g * sch_g + op, mask=op < P, other=0)
        z = tl.load(k + b * sk_b + g * sk_g + c, mask=op < P)
        tl.store(part + b * spa_b + g * spa_g + t * spa_t + op, z.to(part.dtype.element_ty), mask=op < P)


def triton_store(k, v, pool_k, pool_v, at, ws_k, ws_v, partial, channels) -> None:
    """store_row's op as one kernel launch (rows of k, v, the pools and the working sets contiguous in their last
    dim; any other strides)."""
    B, G, _, dk = k.shape
    dv = v.shape[-1]
    p = 0 if partial is None else partial.shape[-1]
    part = partial if partial is not None else pool_k  # (unread when P is 0)
    ch = channels if channels is not None else at
    s = [t.stride() for t in (k, v, pool_k, pool_v, ws_k, ws_v, part)]
    _store_row[(B * G,)](
        k, v, pool_k, pool_v, at, ws_k, ws_v, part, ch,
        s[0][0], s[0][1], s[1][0], s[1][1], *s[2][:3], *s[3][:3], s[4][0], s[4][1], s[5][0], s[5][1], *s[6][:3],
        ch.stride(0) if channels is not None else 0,
        G, DK=dk, DV=dv, P=p, BK=triton.next_power_of_2(dk), BV=triton.next_power_of_2(dv),
        BP=triton.next_power_of_2(max(p, 1)))
