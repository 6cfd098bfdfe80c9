"""The Triton kernel of store_row.py (imported on a GPU, where PyTorch's CUDA wheels bring Triton; on CPU the tests
run it with TRITON_INTERPRET=1)."""

from __future__ import annotations

import triton
import triton.language as tl

# 1.5 x 2^23: (x + RINT) - RINT rounds a float32 |x| < 2^22 to the nearest integer, ties to even (a constexpr: a
# jitted function reads no plain global)
RINT = tl.constexpr(12582912.0)


@triton.jit
def _q8_row(x, dst_a, dst_b, D: tl.constexpr, BG: tl.constexpr):
    """x (BG,) float32, zeros past D -> the int8 row of model/int8_rows.py's pack_kv (llama.cpp's q8_0: the values
    of each group of 32 by its absmax / 127 rounded to float16, then the groups' float16 scales), written to the
    rows at dst_a and dst_b, with pack_kv's bits (IEEE division, ties to even)."""
    xg = tl.reshape(x, (BG // 32, 32))
    scale = tl.minimum(tl.math.div_rn(tl.max(tl.abs(xg), axis=1), 127.0), 65504.0).to(tl.float16)  # (groups,)
    sf = scale.to(tl.float32)[:, None]
    q = tl.where(sf > 0, tl.math.div_rn(xg, tl.where(sf > 0, sf, 1.0)), 0.0)
    q = tl.minimum(tl.maximum((q + RINT) - RINT, -127.0), 127.0)
    values = tl.reshape(q, (BG,)).to(tl.int8)
    dd = tl.arange(0, BG)
    tl.store(dst_a + dd, values, mask=dd < D)
    tl.store(dst_b + dd, values, mask=dd < D)
    gg = tl.arange(0, BG // 32)
    groups = (D + 31) // 32
    tl.store((dst_a + D).to(tl.pointer_type(tl.float16)) + gg, scale, mask=gg < groups)
    tl.store((dst_b + D).to(tl.pointer_type(tl.float16)) + gg, scale, mask=gg < groups)


@triton.jit
def _store_row(k, v, pk, pv, at, wk, wv, part, ch,
               sk_b, sk_g, sv_b, sv_g, spk_b, spk_g, spk_t, spv_b, spv_g, spv_t,
               swk_b, swk_g, swv_b, swv_g, spa_b, spa_g, spa_t, sch_g,
               G, DK: tl.constexpr, DV: tl.constexpr, P: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr, BP: tl.constexpr, Q8: tl.constexpr):
    """One program per (sequence, KV head): its K and V row to the pool at column `at` and to working-set slot 0 (Q8:
    quantized to int8 rows on the way), its raw channels ch[g] of K to the partial key cache at `at`."""
    row = tl.program_id(0)
    b, g = row // G, row % G
    t = tl.load(at)
    ok = tl.arange(0, BK)
    x = tl.load(k + b * sk_b + g * sk_g + ok, mask=ok < DK, other=0.0)
    ov = tl.arange(0, BV)
    y = tl.load(v + b * sv_b + g * sv_g + ov, mask=ov < DV, other=0.0)
    if Q8:
        _q8_row(x.to(tl.float32), pk + b * spk_b + g * spk_g + t * spk_t, wk + b * swk_b + g * swk_g, DK, BK)
        _q8_row(y.to(tl.float32), pv + b * spv_b + g * spv_g + t * spv_t, wv + b * swv_b + g * swv_g, DV, BV)
    else:
        tl.store(pk + b * spk_b + g * spk_g + t * spk_t + ok, x.to(pk.dtype.element_ty), mask=ok < DK)
        tl.store(wk + b * swk_b + g * swk_g + ok, x.to(wk.dtype.element_ty), mask=ok < DK)
        tl.store(pv + b * spv_b + g * spv_g + t * spv_t + ov, y.to(pv.dtype.element_ty), mask=ov < DV)
        tl.store(wv + b * swv_b + g * swv_g + ov, y.to(wv.dtype.element_ty), mask=ov < DV)
    if P > 0:
        op = tl.arange(0, BP)
        c = tl.load(ch + g * sch_g + op, mask=op < P, other=0)
        z = tl.load(k + b * sk_b + g * sk_g + c, mask=op < P)
        tl.store(part + b * spa_b + g * spa_g + t * spa_t + op, z.to(part.dtype.element_ty), mask=op < P)


def triton_store(k, v, pool_k, pool_v, at, ws_k, ws_v, partial, channels) -> None:
    """store_row's op as one kernel launch (rows of k, v, the pools and the working sets contiguous in their last
    dim; any other strides). Floating k, v into int8 pools are quantized in the kernel."""
    B, G, _, dk = k.shape
    dv = v.shape[-1]
    q8 = pool_k.dtype.itemsize == 1 and k.dtype.is_floating_point  # (torch.int8: quantized here)
    p = 0 if partial is None else partial.shape[-1]
    part = partial if partial is not None else pool_k  # (unread when P is 0)
    ch = channels if channels is not None else at
    s = [t.stride() for t in (k, v, pool_k, pool_v, ws_k, ws_v, part)]
    block = (lambda d: max(32, triton.next_power_of_2(d))) if q8 else triton.next_power_of_2  # whole groups of 32
    _store_row[(B * G,)](
        k, v, pool_k, pool_v, at, ws_k, ws_v, part, ch,
        s[0][0], s[0][1], s[1][0], s[1][1], *s[2][:3], *s[3][:3], s[4][0], s[4][1], s[5][0], s[5][1], *s[6][:3],
        ch.stride(0) if channels is not None else 0,
        G, DK=dk, DV=dv, P=p, BK=block(dk), BV=block(dv), BP=triton.next_power_of_2(max(p, 1)), Q8=q8)
