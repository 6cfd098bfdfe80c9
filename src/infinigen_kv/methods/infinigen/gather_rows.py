"""A static decode step's fetch: the chosen rows of K and V gathered from the pool into the layer's working set
[new token | chosen rows] (slots 1..m), in one op. In PyTorch that is two element-wise gathers, which on a GPU read
the pinned pool through its device view two bytes at a time (30 GB/s measured on an H200, against the 48 GB/s of a
row-wise index_select and the link's 55); on a GPU one Triton kernel copies whole rows for K and V at once,
launched from a custom op (so a CUDA graph captures it, and the step's op trace counts it once). Where Triton is
missing or its kernel fails to build, the op runs the PyTorch ops (the reference, which the tests compare the
kernel against on CPU, through TRITON_INTERPRET=1).

Shapes: pool_k, pool_v (B, G, capacity, dk / dv) (on a GPU a device view of the pinned pool), rows contiguous;
idx (B, G, m) int64 pool positions; ws_k, ws_v (B, G, 1 + m, dk / dv) contiguous.
"""

from __future__ import annotations

import torch

from ...model.triton_kernel import TritonKernel


def reference(pool_k, pool_v, idx, ws_k, ws_v) -> None:
    """The op in PyTorch ops."""
    B, G, m = idx.shape
    for pool, ws in ((pool_k, ws_k), (pool_v, ws_v)):
        d = pool.shape[-1]
        out = ws.view(B * G, m + 1, d)[:, 1:]
        torch.gather(pool.reshape(B * G, -1, d), 1, idx.reshape(B * G, m, 1).expand(B * G, m, d), out=out)


KERNEL = TritonKernel("methods.infinigen.gather_rows_triton:triton_gather", "row gather")


@torch.library.custom_op("infinigen::gather_rows", mutates_args=("ws_k", "ws_v"))
def gather_rows(pool_k: torch.Tensor, pool_v: torch.Tensor, idx: torch.Tensor, ws_k: torch.Tensor,
                ws_v: torch.Tensor) -> None:
    """The module's op (see its docstring): PyTorch ops off the GPU."""
    reference(pool_k, pool_v, idx, ws_k, ws_v)


@gather_rows.register_kernel("cuda")
def _gather_rows_cuda(pool_k, pool_v, idx, ws_k, ws_v) -> None:
    KERNEL(reference, pool_k, pool_v, idx, ws_k, ws_v)
