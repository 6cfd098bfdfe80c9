"""One decode query per sequence over a cache layer's keys under a mask, on a GPU: the attention every decode step
runs there (full's whole buffers, InfiniGen's working set), eager or replayed in a CUDA graph.

PyTorch's SDPA serves such a query badly once a mask is given: it falls back to its memory-efficient kernel, which
parallelises over queries and heads only (for a Llama-3.1-8B step at 16k on an H200: 21 ms of attention where the
flash kernel without a mask takes 1). A static step always has a mask (the valid columns of its capacity), so the
query is split over the keys instead (flash-decoding): each program attends one (sequence, KV head) over a fixed
span of keys (decode_attention_triton.SPLIT) with an online softmax; a second kernel combines the spans, a fixed
number at a time and those in order. Spans start at fixed key positions and masked keys add exact zeros, so a
static step over its whole capacity gives the bits of an eager step over its n keys (graph tokens equal eager
tokens).

Shapes: q (B, G, r, d) (the r query heads of a KV head's group); key, value (B, G, m, d), rows contiguous, any
other strides, or int8 rows (B, G, m, kv_width(d)) (model/int8_rows.py), read where they lie (no dequantized
copy); mask None or bool (B, 1 or G, 1, m), any strides (True: attend); scale the scores' factor.
-> (B, G, r, d) in q's dtype. Off the GPU, and where Triton is missing or fails, PyTorch's SDPA (the reference the
tests compare the kernel against on CPU, through TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kv import from_rows
from .triton_kernel import TritonKernel

def reference(q, key, value, mask, scale: float) -> torch.Tensor:
    """The op in PyTorch ops (SDPA; K/V in the query's dtype)."""
    key, value = from_rows(key, q.dtype), from_rows(value, q.dtype)
    return F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale)


KERNEL = TritonKernel("model.decode_attention_triton:triton_decode_attention", "decode attention")


def decode_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """The module's function (see its docstring): the Triton kernels on a GPU, PyTorch's SDPA elsewhere. A plain
    function, not a custom op: an eager step calls it once a layer, and a custom op's dispatch costs tens of us."""
    if q.is_cuda:
        if key.dtype not in (q.dtype, torch.int8):  # rows of another float dtype: computed in the query's
            key, value = key.to(q.dtype), value.to(q.dtype)
        return KERNEL(reference, q, key, value, mask, scale)
    return reference(q, key, value, mask, scale)
