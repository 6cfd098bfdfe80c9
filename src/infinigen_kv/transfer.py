"""Moving the selected KV rows from the host pool to where attention runs.

`DirectTransfer` (CPU compute): pool and compute share memory, there is nothing to hide, so the rows are
gathered when the layer runs, in one index_select that also takes the new token's row.

`CudaTransfer`: at layer l's speculation the indices go to the host (pinned, async); a worker thread
waits for them, gathers the rows from the pinned pool into a pinned staging buffer and copies them to the
GPU on a side stream, recording an event. Layer l keeps computing meanwhile. Layer l+1 waits on that
event only: never a device-wide synchronize.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


_SLOTS = {}


def work_mask(count: torch.Tensor, m: int) -> torch.Tensor:
    """Mask of a working set [new token, m fetched slots] whose first count slots are real: (B, G, 1, m + 1)."""
    slots = _SLOTS.get(count.device)
    if slots is None or slots.numel() < m + 1:
        slots = _SLOTS[count.device] = torch.arange(max(2 * (m + 1), 4096), device=count.device)
    return (slots[: m + 1] <= count.unsqueeze(-1)).unsqueeze(2)


class Scratch:
    """Persistent flat buffers reused every step (no allocator traffic in the decode loop)."""

    def __init__(self, device, pin: bool = False):
        self.device, self.pin, self.bufs = torch.device(device), pin, {}

    def get(self, name: str, shape: tuple, dtype) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
        buf = self.bufs.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(max(numel, 2 * (buf.numel() if buf is not None else 0)), dtype=dtype,
                              device=self.device, pin_memory=self.pin)
            self.bufs[name] = buf
        return buf[:numel].view(shape)


class DirectTransfer:
    """CPU: gather the selected rows and the new token's row straight into the working set."""

    def prefetch(self, layer, idx: torch.Tensor, count: torch.Tensor) -> None:
        layer.pending = (idx, count)

    def fetch(self, layer, pending, k_new: torch.Tensor, v_new: torch.Tensor):
        """-> K, V (B, G, m + 1, d): [new token, fetched rows], and their mask (B, G, 1, m + 1).
        The pool already holds the new token; one index_select per tensor takes all of it."""
        idx, count = pending
        B, G, m = idx.shape
        base = layer.k.row_base()  # K and V grow together: same capacity, same offsets
        rows = layer.scratch.get("rows", (B, G, m + 1), idx.dtype)
        torch.add(base, layer.k.length - 1, out=rows[:, :, :1])  # the new token's row
        torch.add(idx, base, out=rows[:, :, 1:])
        K = layer.k.gather_flat(rows, out=layer.scratch.get("k", (B, G, m + 1, layer.k.width), layer.k.dtype))
        V = layer.v.gather_flat(rows, out=layer.scratch.get("v", (B, G, m + 1, layer.v.width), layer.v.dtype))
        return K, V, work_mask(count, m)

    def dense(self, layer):
        return layer.k.valid(), layer.v.valid()

    def after_append(self, layer) -> None:
        pass


class CudaTransfer:
    """GPU compute, pinned host pool: async index copy, worker-thread gather, side-stream H2D copy."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="infinigen-prefetch")

    def prefetch(self, layer, idx: torch.Tensor, count: torch.Tensor) -> None:
        B, G, m = idx.shape
        idx_host = layer.host_scratch.get("idx", (B, G, m), idx.dtype)
        idx_host.copy_(idx, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()  # on the compute stream, after the selection
        layer.pending = (self.worker.submit(self._gather_copy, layer, idx_host, ready), count, m)

    def _gather_copy(self, layer, idx_host, ready):
        ready.synchronize()  # the indices are on the host
        if layer.written is not None:
            layer.written.synchronize()  # the pool's async writes of this layer have landed
        if layer.copied is not None:
            layer.copied.synchronize()  # the staging buffer's previous copy is done before we overwrite it
        B, G, m = idx_host.shape
        sk = layer.k.gather(idx_host, out=layer.host_scratch.get("k", (B, G, m, layer.k.width), layer.k.dtype))
        sv = layer.v.gather(idx_host, out=layer.host_scratch.get("v", (B, G, m, layer.v.width), layer.v.dtype))
        with torch.cuda.stream(self.stream):
            if layer.consumed is not None:
                self.stream.wait_event(layer.consumed)  # the device buffers were read by the last step
            dk = layer.scratch.get("k", sk.shape, sk.dtype)
            dv = layer.scratch.get("v", sv.shape, sv.dtype)
            dk.copy_(sk, non_blocking=True)
            dv.copy_(sv, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        layer.copied = done
        return dk, dv, done

    def fetch(self, layer, pending, k_new, v_new):
        future, count, m = pending
        dk, dv, done = future.result()  # CPU-side wait for the worker (normally already finished)
        torch.cuda.current_stream(self.device).wait_event(done)  # the GPU waits on this copy only
        K = torch.cat([k_new, dk], dim=2)  # [new token, fetched rows], as on the direct path
        V = torch.cat([v_new, dv], dim=2)
        consumed = torch.cuda.Event()
        consumed.record()
        layer.consumed = consumed
        return K, V, work_mask(count, m)

    def dense(self, layer):
        """A whole layer to the device (dense layers live there already; others only on the rare
        chunked-prefill path)."""
        if layer.k.device == self.device:
            return layer.k.valid(), layer.v.valid()
        if layer.written is not None:
            layer.written.synchronize()
        return layer.k.valid().to(self.device), layer.v.valid().to(self.device)

    def after_append(self, layer) -> None:
        """Record when the (async, device-to-pinned) pool write of this layer is complete."""
        if layer.k.device.type == "cpu":
            written = torch.cuda.Event()
            written.record()
            layer.written = written


def make_transfer(device: torch.device):
    return CudaTransfer(device) if torch.device(device).type == "cuda" else DirectTransfer()
