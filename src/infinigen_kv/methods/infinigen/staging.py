"""The CUDA path's pieces around the move (cuda_transfer.py): the staging ring the fetches of a device share, the
worker thread's inference mode, a device view of pinned host memory (kernels read it over the bus), copies of
contiguous rows, the caching allocator told which stream uses a tensor."""

from __future__ import annotations

import torch

from ..rows import RowBuffer
from .fetch import Scratch


def submit_inference(executor, fn, *args):
    """executor.submit(fn, *args) with fn under torch.inference_mode() in the worker thread: inference mode
    is per thread, and the pool tensors made under it in the caller's (ig.generate) may only be written
    in place under it ("Inplace update to inference tensor outside InferenceMode" otherwise)."""

    def run():
        with torch.inference_mode():
            return fn(*args)

    return executor.submit(run)


class StagingRing:
    """`slots` staging slots used in turn by the fetches of every layer of one device: a pinned host buffer
    the worker gathers into, a device buffer the side stream copies to, and the events that say when each
    may be overwritten (`copied`: the copy out of the host buffer is done; `consumed`: attention has read
    the device buffer). A fetch holds its slot from its prefetch to its layer's fetch."""

    def __init__(self, device, cuda, slots: int = 3, pin: bool = True):
        self.host = [Scratch("cpu", pin=pin) for _ in range(slots)]
        self.dev = [Scratch(device) for _ in range(slots)]
        self.copied = [cuda.Event() for _ in range(slots)]  # made once: recorded again at each use
        self.consumed = [cuda.Event() for _ in range(slots)]
        self.used = [False] * slots  # whether the events above have been recorded yet
        self.busy = [False] * slots
        self.next = 0

    def acquire(self) -> int:
        i = self.next
        if self.busy[i]:  # the schedule keeps at most two fetches in flight: this is a bug, not a wait
            raise RuntimeError(f"staging ring overrun: more than {len(self.busy)} fetches in flight")
        self.busy[i] = True
        self.next = (i + 1) % len(self.busy)
        return i

    def release(self, i: int, stream) -> None:
        self.consumed[i].record(stream)
        self.busy[i] = False

    def reset(self) -> None:
        self.busy = [False] * len(self.busy)
        self.next = 0


def rows_to(buf: RowBuffer, n: int, out: torch.Tensor) -> None:
    """The first n rows of every (sequence, head) of a host buffer into out (B, G, n, width) on the device:
    one copy per (sequence, head), each of contiguous rows (a strided pinned source would be staged through
    pageable memory and block), async from pinned memory."""
    if buf.capacity == n and buf.data.is_contiguous() and out.is_contiguous():
        out.copy_(buf.data, non_blocking=True)
        return
    src = buf.data.flatten(0, 1)  # (B * G, capacity, width): a view
    dst = out.flatten(0, 1)
    for i in range(src.shape[0]):
        dst[i].copy_(src[i, :n], non_blocking=True)


class _HostArray:
    """__cuda_array_interface__ of a pinned host tensor's bytes: torch.as_tensor makes a CUDA tensor of them,
    which kernels read and write over the bus (pinned memory is mapped into the GPU's address space)."""

    def __init__(self, t: torch.Tensor):
        self.__cuda_array_interface__ = {"shape": (t.numel() * t.element_size(),), "typestr": "|u1",
                                         "data": (t.data_ptr(), False), "version": 3}


def device_view(t: torch.Tensor, device) -> torch.Tensor:
    """A device tensor aliasing pinned host tensor t (contiguous), same dtype and shape: zero-copy."""
    return torch.as_tensor(_HostArray(t), device=device).view(t.dtype).view(t.shape)


_UVA = {}


def uva_works(device) -> bool:
    """Whether kernels on `device` read pinned host memory through a device view (checked once per device)."""
    device = torch.device(device)
    if device not in _UVA:
        try:
            host = torch.arange(64, dtype=torch.float32).pin_memory()
            view = device_view(host, device)
            got = view.index_select(0, torch.tensor([3, 60], device=device)).cpu()
            _UVA[device] = got.tolist() == [3.0, 60.0]
        except Exception:
            _UVA[device] = False
    return _UVA[device]


def record_stream(t: torch.Tensor, stream) -> None:
    """Tell the caching allocator that `stream` uses t (a device tensor): freeing t then waits for it."""
    if t.is_cuda:
        t.record_stream(stream)
