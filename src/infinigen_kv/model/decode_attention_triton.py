"""The Triton kernels of decode_attention.py (imported on a GPU, where PyTorch's CUDA wheels bring Triton; on CPU the
tests run them with TRITON_INTERPRET=1)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .int8_rows import GROUP, kv_width

assert GROUP == 32  # the kernel's groups of scales

SPLIT = 256  # keys per program: B * G * m / SPLIT programs (B1 x 16k, 8 KV heads: 512 on 132 SMs)


@triton.jit
def _dequantized(values, scales, dd, rows, dtype):
    """int8 values (BN, BD) of rows whose float16 scales start at `scales` (BN, 1), one per 32 values -> `dtype`."""
    sc = tl.load(scales.to(tl.pointer_type(tl.float16)) + dd[None, :] // 32, mask=rows, other=0.0)
    return (values.to(tl.float32) * sc.to(tl.float32)).to(dtype)


@triton.jit
def _span(q, k, v, mask, o, ml, sq_b, sq_g, sq_r, sk_b, sk_g, sk_t, sv_b, sv_g, sv_t, sm_b, sm_g, sm_t,
          G, M, NS, scale, R: tl.constexpr, BR: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
          SPAN: tl.constexpr, BN: tl.constexpr, HAS_MASK: tl.constexpr, PREC: tl.constexpr, INT8: tl.constexpr):
    """Program (row = b * G + g, s): the R queries of (b, g) over keys [s * SPAN, (s + 1) * SPAN), online softmax
    in float32 -> o[row, s] (R, D) unnormalised, ml[row, s] = (max, sum of exp) (R,) each. Products in float32:
    exact IEEE for float32 inputs; TF32 on the tensor cores for 16-bit ones, whose values TF32 holds exactly (the
    weights p keep 10 bits, where flash attention rounds them to the inputs' 7 or 10). INT8: K/V are int8 rows
    (model/int8_rows.py: D values, then a float16 scale per 32), each value read back in the query's dtype as
    from_rows gives it."""
    row = tl.program_id(0)
    s = tl.program_id(1)
    b = row // G
    g = row % G
    rr = tl.arange(0, BR)
    dd = tl.arange(0, BD)
    qm = (rr[:, None] < R) & (dd[None, :] < D)
    qv = tl.load(q + b * sq_b + g * sq_g + rr[:, None] * sq_r + dd[None, :], mask=qm, other=0.0).to(tl.float32)
    m_i = tl.full([BR], float("-inf"), tl.float32)
    l_i = tl.full([BR], 0.0, tl.float32)
    acc = tl.full([BR, BD], 0.0, tl.float32)
    for j in range(0, SPAN, BN):
        nn = s * SPAN + j + tl.arange(0, BN)
        ok = nn < M
        if HAS_MASK:
            ok = ok & (tl.load(mask + b * sm_b + g * sm_g + nn * sm_t, mask=ok, other=0) != 0)
        rows = ok[:, None] & (dd[None, :] < D)
        kb = tl.load(k + b * sk_b + g * sk_g + nn[:, None] * sk_t + dd[None, :], mask=rows, other=0.0)
        if INT8:
            kb = _dequantized(kb, k + b * sk_b + g * sk_g + nn[:, None] * sk_t + D, dd, rows, q.dtype.element_ty)
        sc = tl.dot(qv, tl.trans(kb.to(tl.float32)), input_precision=PREC)
        sc = tl.where(ok[None, :], sc * scale, float("-inf"))  # (BR, BN)
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - base)  # 1 exactly where nothing new was attended: masked keys add exact zeros
        p = tl.exp(sc - base[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vb = tl.load(v + b * sv_b + g * sv_g + nn[:, None] * sv_t + dd[None, :], mask=rows, other=0.0)
        if INT8:
            vb = _dequantized(vb, v + b * sv_b + g * sv_g + nn[:, None] * sv_t + D, dd, rows, q.dtype.element_ty)
        acc = acc * alpha[:, None] + tl.dot(p, vb.to(tl.float32), input_precision=PREC)
        m_i = m_new
    at = row * NS + s
    tl.store(o + (at * R + rr[:, None]) * D + dd[None, :], acc, mask=qm)
    tl.store(ml + at * 2 * R + rr, m_i, mask=rr < R)
    tl.store(ml + at * 2 * R + R + rr, l_i, mask=rr < R)


@triton.jit
def _combine(o, ml, out, so_b, so_g, so_r, G, NS, R: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
             CH: tl.constexpr):
    """Program (row = b * G + g, query head r): its NS spans combined, CH spans at a time (a fixed tree over each
    chunk, the chunks in order: spans past the keys are all masked and add exact zeros, so a longer capacity gives
    the same bits) -> out[b, g, r] (D,)."""
    row = tl.program_id(0)
    r = tl.program_id(1)
    b = row // G
    g = row % G
    dd = tl.arange(0, BD)
    cc = tl.arange(0, CH)
    mx = tl.max(tl.full([CH], float("-inf"), tl.float32), 0)
    for c in range(0, NS, CH):
        at = row * NS + c + cc
        mx = tl.maximum(mx, tl.max(tl.load(ml + at * 2 * R + r, mask=c + cc < NS, other=float("-inf")), 0))
    base = tl.where(mx == float("-inf"), 0.0, mx)
    den = tl.sum(tl.full([CH], 0.0, tl.float32), 0)
    acc = tl.full([BD], 0.0, tl.float32)
    for c in range(0, NS, CH):
        at = row * NS + c + cc
        ok = c + cc < NS
        w = tl.exp(tl.load(ml + at * 2 * R + r, mask=ok, other=float("-inf")) - base)  # (CH,)
        den += tl.sum(w * tl.load(ml + at * 2 * R + R + r, mask=ok, other=0.0), 0)
        blk = tl.load(o + (at[:, None] * R + r) * D + dd[None, :], mask=ok[:, None] & (dd[None, :] < D), other=0.0)
        acc += tl.sum(w[:, None] * blk, 0)
    res = tl.where(den > 0, acc / tl.where(den > 0, den, 1.0), 0.0)  # a query with no key attended: zeros
    tl.store(out + b * so_b + g * so_g + r * so_r + dd, res.to(out.dtype.element_ty), mask=dd < D)


def triton_decode_attention(q, key, value, mask, scale: float) -> torch.Tensor:
    """decode_attention's op as two kernel launches (see decode_attention.py for the shapes)."""
    B, G, R, D = q.shape
    M = key.shape[2]
    int8 = key.dtype == torch.int8  # int8 rows (D values and their scales), read where they lie
    if int8 and (value.dtype != torch.int8 or key.shape[3] != kv_width(D) or value.shape[3] != kv_width(D)):
        raise ValueError("int8 K/V rows are read as model/int8_rows.py stores them, K and V alike")
    if key.stride(3) != 1 or value.stride(3) != 1:
        raise ValueError("decode attention reads rows contiguous in their last dim")
    q = q if q.stride(3) == 1 else q.contiguous()
    NS = triton.cdiv(M, SPLIT)
    o = torch.empty(B * G, NS, R, D, dtype=torch.float32, device=q.device)
    ml = torch.empty(B * G, NS, 2, R, dtype=torch.float32, device=q.device)
    out = torch.empty(B, G, R, D, dtype=q.dtype, device=q.device)
    if mask is not None:
        mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        sm = (mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(1) if mask.shape[1] > 1 else 0, mask.stride(3))
    else:
        mask, sm = q, (0, 0, 0)  # (unread)
    BR, BD = max(16, triton.next_power_of_2(R)), max(16, triton.next_power_of_2(D))
    _span[(B * G, NS)](q, key, value, mask, o, ml, q.stride(0), q.stride(1), q.stride(2), key.stride(0),
                       key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2), *sm,
                       G, M, NS, float(scale), R=R, BR=BR, D=D, BD=BD, SPAN=SPLIT, BN=64,
                       HAS_MASK=mask is not q, PREC="ieee" if q.dtype == torch.float32 else "tf32", INT8=int8)
    _combine[(B * G, R)](o, ml, out, out.stride(0), out.stride(1), out.stride(2), G, NS, R=R, D=D, BD=BD, CH=16)
    return out
