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

from . import kernels
from .speculate import counted


def work_mask(real: torch.Tensor | None) -> torch.Tensor | None:
    """Mask (B, G, 1, m + 1) of a working set [new token, m fetched slots] from which fetched slots are
    real (B, G, m); None when all of them are (attention then runs unmasked)."""
    if real is None:
        return None
    return torch.cat([real.new_ones(real.shape[:2] + (1,)), real], dim=-1).unsqueeze(2)


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
    """CPU: attention reads the selected rows where they lie in the pool (the CPU kernel), or gathers them
    and the new token's row straight into the working set in one index_select (no kernel, or a full pool
    whose new token is about to overwrite a selected victim)."""

    def prefetch(self, layer, idx: torch.Tensor, real: torch.Tensor | None, count: torch.Tensor | None = None) -> None:
        layer.pending = (idx, real, count)

    def ready(self, layer, pending):
        """-> (idx, real, count) once the prefetch of `layer` is complete (at once: nothing is in flight)."""
        return pending

    def write(self, layer, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor | None = None) -> None:
        """New rows into the pool: appended, or one decode row over slots slot (B, G) of a full pool."""
        if slot is None:
            layer.k.append(k)
            layer.v.append(v)
        else:
            layer.k.put(slot, k)
            layer.v.put(slot, v)

    def fetch(self, layer, ready, k_new: torch.Tensor, v_new: torch.Tensor):
        """-> K, V and their mask for attention: the whole pool buffers with `layer.fused` set (the kernel
        reads [new token, chosen rows] in place), or a gathered working set (B, G, m + 1, d) with its mask
        (B, G, 1, m + 1)."""
        idx, real, count = ready  # count (B, G): the first count slots of each row are real (CPU kernel)
        B, G, m = idx.shape
        if layer.cache.speculates and layer.new_slot is not None and (count is not None or real is None) \
                and kernels.cpu() is not None:
            layer.fused = (idx, count, layer.new_slot)
            return layer.k.data, layer.v.data, None
        if count is not None:
            real = counted(count, m)
        if layer.new_slot is None:  # a full pool, before the new token overwrites a victim: gather, then join
            K = layer.scratch.get("k", (B, G, m + 1, layer.k.width), layer.k.dtype)
            V = layer.scratch.get("v", (B, G, m + 1, layer.v.width), layer.v.dtype)
            torch.cat([k_new, layer.k.gather(idx)], dim=2, out=K)
            torch.cat([v_new, layer.v.gather(idx)], dim=2, out=V)
            return K, V, work_mask(real)
        base = layer.k.row_base()  # K and V grow together: same capacity, same offsets
        rows = layer.scratch.get("rows", (B, G, m + 1), idx.dtype)
        new = layer.new_slot if isinstance(layer.new_slot, int) else layer.new_slot.unsqueeze(-1)
        torch.add(base, new, out=rows[:, :, :1])  # the new token's row
        torch.add(idx, base, out=rows[:, :, 1:])
        K = layer.k.gather_flat(rows, out=layer.scratch.get("k", (B, G, m + 1, layer.k.width), layer.k.dtype))
        V = layer.v.gather_flat(rows, out=layer.scratch.get("v", (B, G, m + 1, layer.v.width), layer.v.dtype))
        return K, V, work_mask(real)

    def dense(self, layer):
        return layer.k.valid(), layer.v.valid()

    def flush(self, layer) -> None:
        """Nothing in flight on the direct path."""


def submit_inference(executor, fn, *args):
    """executor.submit(fn, *args) with fn under torch.inference_mode() in the worker thread: inference mode
    is per thread, and the pool tensors made under it in the caller's (ig.generate) may only be written
    in place under it ("Inplace update to inference tensor outside InferenceMode" otherwise)."""

    def run():
        with torch.inference_mode():
            return fn(*args)

    return executor.submit(run)


class CudaTransfer:
    """GPU compute, pinned host pool: async index copy, worker-thread gather, side-stream H2D copy.

    Who touches a layer's pool when: the worker only between `prefetch` (in the previous layer's
    pre-hook) and `ready` (in this layer's update); the main thread only after `ready`. So the pool and
    its staging buffers need no lock, only the events below.
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="infinigen-prefetch")

    def compute_stream(self):
        """The stream this device's layers compute on (with device_map, not necessarily the current
        device's): every event of a layer is recorded there."""
        return torch.cuda.current_stream(self.device)

    def prefetch(self, layer, idx: torch.Tensor, real: torch.Tensor | None, count=None) -> None:
        B, G, m = idx.shape
        idx_host = layer.host_scratch.get("idx", (B, G, m), idx.dtype)
        idx_host.copy_(idx, non_blocking=True)
        selected = torch.cuda.Event()
        selected.record(self.compute_stream())  # after the selection and the index copy
        layer.pending = (submit_inference(self.worker, self._gather_copy, layer, idx_host, selected), idx, real)

    def _gather_copy(self, layer, idx_host, selected):
        selected.synchronize()  # the indices are on the host
        self.flush(layer)  # the last step's new row is in the pool
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

    def ready(self, layer, pending):
        future, idx, real = pending
        dk, dv, done = future.result()  # CPU-side wait for the worker (normally finished already)
        torch.cuda.current_stream(self.device).wait_event(done)  # the GPU waits on this copy only
        return idx, real, (dk, dv)

    def write(self, layer, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor | None = None) -> None:
        """New rows into the pool. A decode row goes device -> contiguous pinned staging asynchronously
        (a strided pinned destination would make the copy blocking), with its target slots (B, G) when it
        overwrites evicted entries; the worker moves it into the pool (`flush`) before its next gather of
        this layer."""
        if layer.k.device.type != "cpu" or k.shape[2] > 1:  # device-resident layer, or prefill
            self.flush(layer)
            DirectTransfer.write(self, layer, k, v, slot)
            return
        self.flush(layer)  # at most one row in flight per layer
        sk = layer.host_scratch.get("new_k", k.shape, k.dtype)
        sv = layer.host_scratch.get("new_v", v.shape, v.dtype)
        sk.copy_(k, non_blocking=True)
        sv.copy_(v, non_blocking=True)
        if slot is None:
            target = layer.k.length
            layer.k.reserve(target + 1)
            layer.v.reserve(target + 1)
            layer.k.length += 1
            layer.v.length += 1
        else:
            target = layer.host_scratch.get("slot", slot.shape, slot.dtype)
            target.copy_(slot, non_blocking=True)
        written = torch.cuda.Event()
        written.record(self.compute_stream())
        layer.unflushed = (written, sk, sv, target)

    @staticmethod
    def flush(layer) -> None:
        if layer.unflushed is None:
            return
        written, sk, sv, target = layer.unflushed
        written.synchronize()  # this event only: the row (and its slots) have landed in pinned memory
        if isinstance(target, int):
            layer.k.data[:, :, target : target + 1].copy_(sk)
            layer.v.data[:, :, target : target + 1].copy_(sv)
        else:
            layer.k.put(target, sk)
            layer.v.put(target, sv)
        layer.unflushed = None

    def fetch(self, layer, ready, k_new, v_new):
        idx, real, (dk, dv) = ready
        K = torch.cat([k_new, dk], dim=2)  # [new token, fetched rows], as on the direct path
        V = torch.cat([v_new, dv], dim=2)
        consumed = torch.cuda.Event()
        consumed.record(self.compute_stream())
        layer.consumed = consumed
        return K, V, work_mask(real)

    def dense(self, layer):
        """A whole layer on the device (dense layers live there already; others only on the rare
        chunked-prefill path)."""
        if layer.k.device == self.device:
            return layer.k.valid(), layer.v.valid()
        self.flush(layer)
        return layer.k.valid().to(self.device), layer.v.valid().to(self.device)


def make_transfer(device: torch.device):
    return CudaTransfer(device) if torch.device(device).type == "cuda" else DirectTransfer()
