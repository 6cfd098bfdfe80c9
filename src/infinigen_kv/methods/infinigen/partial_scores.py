"""The speculation's scores over partial keys held in 16 bits (bfloat16 on a GPU): float32 logits of the float32
partial queries, each key widened in registers. In PyTorch that is a float32 copy of every layer's whole partial key
cache each step (read 2 bytes, write 4, read 4 a value: 2.5x the bytes of the keys themselves) and then the product;
on a GPU one Triton kernel reads the keys once, launched from a custom op (so a CUDA graph captures it, and a step's
op trace counts it once). Where Triton is missing or its kernel fails to build, the op runs the PyTorch ops (the
reference, which the tests compare the kernel against on CPU, through TRITON_INTERPRET=1).

Shapes: q (B, G, r, p) float32 contiguous; keys (B, G, n, p) bfloat16 / float16, rows contiguous (a static step's:
the partial key cache's whole capacity); bias (B G, 1, n) float32 or None (0 where a position may be attended,
-inf where not). Returns (B, G, r, n) float32: q . k x scale + bias.
"""

from __future__ import annotations

import torch

from ...model.triton_kernel import TritonKernel


def reference(q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor | None, scale: float) -> torch.Tensor:
    """The op in PyTorch ops."""
    q, k = q.float(), keys.float()
    if bias is None:
        s = torch.matmul(q, k.transpose(-1, -2))  # (B, G, r, n)
        return s * scale if scale != 1.0 else s
    B, G, r, p = q.shape
    q = q * scale if scale != 1.0 else q
    return torch.baddbmm(bias, q.reshape(B * G, r, p), k.reshape(B * G, -1, p).transpose(1, 2)).view(B, G, r, -1)


KERNEL = TritonKernel("methods.infinigen.partial_scores_triton:triton_scores", "partial-key scores")


@torch.library.custom_op("infinigen::partial_scores", mutates_args=())
def partial_scores(q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor | None, scale: float) -> torch.Tensor:
    """The module's op (see its docstring): PyTorch ops off the GPU."""
    return reference(q, keys, bias, scale)


@partial_scores.register_kernel("cuda")
def _partial_scores_cuda(q, keys, bias, scale) -> torch.Tensor:
    return KERNEL(reference, q, keys, bias, scale)


@partial_scores.register_fake
def _(q, keys, bias, scale) -> torch.Tensor:
    return q.new_empty(*q.shape[:3], keys.shape[2], dtype=torch.float32)
