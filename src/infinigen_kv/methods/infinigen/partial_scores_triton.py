"""The Triton kernel of partial_scores.py (imported on a GPU, where PyTorch's CUDA wheels bring Triton; on CPU the
tests run it with TRITON_INTERPRET=1)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 64  # keys a program scores: (BLOCK, p) widened to float32 in registers, r query heads against them


@triton.jit
def _scores(q, k, bias, out, n, sk_b, sk_g, sk_t, sb_row, sb_t, G, scale, R: tl.constexpr, P: tl.constexpr,
            BP: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Program (row = b * G + g, block): keys block * BLOCK + j of (b, g) against its r query heads."""
    row = tl.program_id(0)
    b = row // G
    g = row % G
    tt = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    pp = tl.arange(0, BP)
    ok = tt < n
    keys = tl.load(k + b * sk_b + g * sk_g + tt[:, None] * sk_t + pp[None, :], mask=ok[:, None] & (pp[None, :] < P),
                   other=0.0).to(tl.float32)  # (BLOCK, BP)
    add = tl.zeros((BLOCK,), tl.float32)
    if HAS_BIAS:
        add = tl.load(bias + row * sb_row + tt * sb_t, mask=ok, other=0.0)
    for h in tl.static_range(R):
        qh = tl.load(q + (row * R + h) * P + pp, mask=pp < P, other=0.0)  # (BP,) float32
        s = tl.sum(keys * qh[None, :], axis=1) * scale + add
        tl.store(out + (row * R + h) * n + tt, s, mask=ok)


def triton_scores(q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor | None, scale: float) -> torch.Tensor:
    """partial_scores's op as one kernel launch (see partial_scores.py for the shapes)."""
    B, G, r, p = q.shape
    n = keys.shape[2]
    if q.dtype != torch.float32 or not q.is_contiguous() or keys.stride(-1) != 1:
        raise ValueError("the partial-key scores read float32 queries and key rows contiguous in their last dim")
    if bias is not None and bias.dtype != torch.float32:
        raise ValueError("the partial-key scores add a float32 bias")
    sb = (bias.stride(0), bias.stride(2)) if bias is not None else (0, 0)  # (B G, 1, n): any strides (B = 1: a view)
    out = torch.empty(B, G, r, n, dtype=torch.float32, device=q.device)
    _scores[(B * G, triton.cdiv(n, BLOCK))](q, keys, bias if bias is not None else q, out, n, *keys.stride()[:3], *sb,
                                            G, float(scale), R=r, P=p, BP=triton.next_power_of_2(p), BLOCK=BLOCK,
                                            HAS_BIAS=bias is not None)
    return out
