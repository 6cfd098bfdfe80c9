"""A static decode step's new row, stored everywhere it goes in one op: its K and V into the pool at the step's
column, into slot 0 of the layer's working set [new token | chosen rows], and its partial key (the raw channels
P of K) into the partial key cache at the same column. In PyTorch that is six kernels a layer (two index
copies, two copies, a gather and an index copy); on a GPU one Triton kernel, launched from a custom op (so a CUDA
graph captures it, and the step's op trace counts it once, as the GPU runs it: store_row_triton.py). Where Triton
is missing or its kernel fails to build, the op runs the PyTorch ops (the reference, which the tests compare the
kernel against on CPU, through TRITON_INTERPRET=1).

Shapes: k, v (B, G, 1, dk / dv); pool_k, pool_v (B, G, capacity, dk / dv) (on a GPU a device view of the pinned
pool); at (1,) int64 on the device; ws_k, ws_v (B, G, 1 + m, dk / dv); partial (B, G, capacity, p) and channels
(G, p) int64, or both None. Strides may be any (rows contiguous). int8 pools and working sets hold q8_0 rows
(width kv_width(d)): k, v as computed are quantized in the op (the kernel: in registers; it took a dozen PyTorch
ops a layer), or given as int8 rows already.
"""

from __future__ import annotations

import torch

from ...model.kv import to_rows
from ...model.triton_kernel import TritonKernel


def reference(k, v, pool_k, pool_v, at, ws_k, ws_v, partial, channels) -> None:
    """The op in PyTorch ops."""
    rk, rv = to_rows(k, pool_k.dtype), to_rows(v, pool_v.dtype)  # int8 pools: q8_0 rows (model/int8_rows.py)
    pool_k.index_copy_(2, at, rk)
    pool_v.index_copy_(2, at, rv)
    ws_k[:, :, :1].copy_(rk)
    ws_v[:, :, :1].copy_(rv)
    if partial is not None:
        B, G = k.shape[:2]
        rows = k.gather(-1, channels.view(1, G, 1, -1).expand(B, G, 1, -1))  # (B, G, 1, p)
        partial.index_copy_(2, at, rows.to(partial.dtype))


KERNEL = TritonKernel("methods.infinigen.store_row_triton:triton_store", "row store")


@torch.library.custom_op("infinigen::store_row", mutates_args=("pool_k", "pool_v", "ws_k", "ws_v", "partial"))
def store_row(k: torch.Tensor, v: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, at: torch.Tensor,
              ws_k: torch.Tensor, ws_v: torch.Tensor, partial: torch.Tensor | None,
              channels: torch.Tensor | None) -> None:
    """The module's op (see its docstring): PyTorch ops off the GPU."""
    reference(k, v, pool_k, pool_v, at, ws_k, ws_v, partial, channels)


@store_row.register_kernel("cuda")
def _store_row_cuda(k, v, pool_k, pool_v, at, ws_k, ws_v, partial, channels) -> None:
    KERNEL(reference, k, v, pool_k, pool_v, at, ws_k, ws_v, partial, channels)
