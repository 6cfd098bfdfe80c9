"""Moving KV rows between the host pool and where attention runs. A transfer engine owns all the state of
the move (staging buffers, events, rows in flight); a cache layer holds only its pool and its selection.

One order for every path, per decode step and layer: the chosen rows are fetched (gathered from the pool
as it was after the previous step), then the new token is stored. The working set handed to attention is
[new token, fetched rows]; on CPU a whole past (offload) is handed as it lies, then the new token: the full
cache's order, so that attention over it gives the full cache's bits.

`DirectTransfer` (CPU compute): pool and compute share memory, there is nothing to hide. With the CPU
kernel, attention reads the chosen rows where they lie in the pool; otherwise they are gathered when the
layer runs into one scratch buffer shared by every layer (they run one after another).

`CudaTransfer` (cuda_transfer.py): a GPU computes, the pool is pinned host memory; the fetch of layer l+1
runs on a side stream behind layer l's compute.
"""

from __future__ import annotations

import torch

from ...model.kv import to_rows
from .fetch import Fetch, Scratch, work_mask


class DirectTransfer:
    """CPU: nothing in flight. `fetch` answers None where the kernel may read the chosen rows in place."""

    host_compute = True  # attention runs where the pool lies: a dense step reads it in place, at no copy
    bytes_moved = None  # nothing crosses to another device
    static = True  # static steps (model/static.py): rows written at a device column, chosen rows gathered

    def __init__(self):
        self.scratch = Scratch("cpu")  # the gathered working set, shared by all layers (sequential)

    def init_layer(self, layer, B: int, G: int, rows: int, staged: bool = True) -> None:
        """Nothing to prepare: no events, no staging."""

    def prefetch(self, layer, fetch: Fetch) -> None:
        """Nothing to start: the layer's view reads the chosen rows when it runs."""

    def ready(self, layer, fetch: Fetch) -> Fetch:
        """`fetch` once the prefetch of `layer` is complete (at once: nothing is in flight)."""
        return fetch

    def write(self, layer, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor | None = None) -> None:
        """New rows into the pool: appended, or one decode row over slots slot (B, G) of a full pool."""
        if slot is None:
            layer.k.append(k)
            layer.v.append(v)
        else:
            layer.k.put(slot, k)
            layer.v.put(slot, v)

    def write_at(self, layer, k: torch.Tensor, v: torch.Tensor, at: torch.Tensor) -> None:
        """A static step's row k, v (B, G, 1, d) at column `at` (1,) of the pool as the compute device writes it
        (device_pool; the host's lengths follow after)."""
        for pool, x in zip(self.device_pool(layer), (k, v)):
            pool.index_copy_(2, at, to_rows(x, pool.dtype))

    def device_pool(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool's K, V (B, G, capacity, d) as the compute device writes them (here: the buffers)."""
        return layer.k.data, layer.v.data

    def fetch(self, layer, fetch: Fetch, k_new: torch.Tensor, v_new: torch.Tensor, in_place: bool):
        """-> None when attention may read [new token, chosen rows] where they lie (in_place: the new token
        will be appended, not written over a slot that may be chosen, and the CPU kernel is built); else
        the working set K, V (B, G, m + 1, d) and its mask (B, G, 1, m + 1)."""
        if in_place and (fetch.count is not None or fetch.real is None) and layer.backend.kernels:
            return None
        B, G, m = fetch.idx.shape
        K = self.scratch.get("k", (B, G, m + 1, layer.k.width), layer.k.dtype)
        V = self.scratch.get("v", (B, G, m + 1, layer.v.width), layer.v.dtype)
        if fetch.whole and not fetch.fixed:  # [the past as it lies, new token] with its mask (B, G, 1, m + 1)
            torch.cat([layer.k.gather(fetch.idx), to_rows(k_new, K.dtype)], dim=2, out=K)
            torch.cat([layer.v.gather(fetch.idx), to_rows(v_new, V.dtype)], dim=2, out=V)
            real = fetch.real_mask()
            return K, V, None if real is None else torch.cat([real, real.new_ones(B, G, 1)], -1).unsqueeze(2)
        if fetch.keys is not None:  # the first c slots' keys made by the selection, the rest's read
            c = fetch.keys.shape[2]
            torch.cat([to_rows(k_new, K.dtype), to_rows(fetch.keys, K.dtype), layer.k.gather(fetch.idx[..., c:])],
                      dim=2, out=K)
        else:
            torch.cat([to_rows(k_new, K.dtype), layer.k.gather(fetch.idx)], dim=2, out=K)
        torch.cat([to_rows(v_new, V.dtype), layer.v.gather(fetch.idx)], dim=2, out=V)
        return K, V, work_mask(fetch.real_mask())

    def dense(self, layer):
        return layer.k.valid(), layer.v.valid()

    def flush(self, layer) -> None:
        """Nothing in flight on the direct path."""

    def reset(self) -> None:
        """Nothing in flight on the direct path."""
