"""A layer's fetch of one decode step (which pool slots, how many of them real) and the working set it makes
for attention: what the speculation hands the transfer engines and they hand attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def counted(count: torch.Tensor, m: int) -> torch.Tensor:
    """(B, G, m) bool: the first count (B, G) slots of each row."""
    return torch.arange(m, device=count.device) < count.unsqueeze(-1)


class Fetch:
    """A layer's fetch of one decode step: slots idx (B, G, m), of which those where real (B, G, m) is True
    are real, or the first count (B, G) of each row, or all when both are None; `whole`: idx is 0..m-1 in
    every row (a transfer may copy the rows as they lie); `keep` (B, 1, n): the past positions the step may
    attend (None: all), `scored`: bytes of partial key read per slot to choose them; `total`: the sum of count where
    the host knows it (the CPU kernel's); `rows` once in flight; `fixed`: a static step's; `keys` (B, G, c, d): the
    keys of the first c slots, made by the selection (their key rows are not read: ShadowKV's rebuilt keys);
    `meta`: bytes a (sequence, KV head) reads besides the rows and partial keys to choose and rebuild them."""

    __slots__ = ("idx", "real", "count", "whole", "keep", "scored", "total", "rows", "fixed", "keys", "meta")

    def __init__(self, idx: torch.Tensor, real: torch.Tensor | None = None, count: torch.Tensor | None = None,
                 whole: bool = False, keep: torch.Tensor | None = None, scored: int = 0, total: int | None = None,
                 fixed: bool = False, keys: torch.Tensor | None = None, meta: int = 0):
        self.idx, self.real, self.count, self.whole, self.rows = idx, real, count, whole, None
        self.keys, self.meta = keys, meta
        self.keep, self.scored, self.total = keep, scored, total
        self.fixed = fixed  # a static step's (model/static.py): its shapes span the pool's capacity

    def real_mask(self) -> torch.Tensor | None:
        return counted(self.count, self.idx.shape[-1]) if self.count is not None else self.real

    def trim(self, m: int) -> None:
        """Only the first m slots are fetched (a row's real ones come first: count)."""
        if m < self.idx.shape[-1]:
            self.idx = self.idx[..., :m]
            self.real = self.real[..., :m] if self.real is not None else None


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


@dataclass(frozen=True)
class PrefillQuery:
    """A prompt's last query, handed to an evicting pool's view at its prefill: x (B, 1, D), RoPE at its position,
    keep (B, 1, T) of the prompt's valid keys (None: all). A prompt larger than the pool keeps what it would fetch."""

    x: torch.Tensor
    rope: tuple | None
    keep: torch.Tensor | None
