"""`quant`: every K/V entry kept, quantized group-wise (asymmetric min-max, groups of 64 along the head
dimension, as FlexGen does) to INT4 (two codes per byte) or INT8; dequantized for attention.

Implemented here rather than through transformers' QuantizedCache: its backends (optimum-quanto, hqq) are
extra dependencies that are not installed here, and neither is FlexGen's exact scheme.
"""

from __future__ import annotations

import torch

from .base import LogicalLayer, Rebatch, read_stats
from .rows import RowBuffer

GROUP = 64


def quantize(x: torch.Tensor, bits: int, group: int = GROUP):
    """x (..., d) -> codes (..., d * bits / 8) uint8, scale and zero (..., d / group) float32."""
    *lead, d = x.shape
    g = min(group, d)
    xg = x.float().reshape(*lead, d // g, g)
    lo = xg.amin(-1, keepdim=True)
    hi = xg.amax(-1, keepdim=True)
    levels = 2**bits - 1
    scale = (hi - lo).clamp_(min=1e-8) / levels
    q = ((xg - lo) / scale).round_().clamp_(0, levels).to(torch.uint8).reshape(*lead, d)
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)  # two 4-bit codes per byte
    return q, scale.squeeze(-1), lo.squeeze(-1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, dtype) -> torch.Tensor:
    """Inverse of `quantize`: (..., d) in `dtype`."""
    if bits == 4:
        q = torch.stack((q & 0xF, q >> 4), dim=-1).flatten(-2)
    *lead, d = q.shape
    groups = scale.shape[-1]
    x = q.reshape(*lead, groups, d // groups).float() * scale.unsqueeze(-1) + zero.unsqueeze(-1)
    return x.reshape(*lead, d).to(dtype)


class QuantLayer(LogicalLayer):
    def __init__(self, bits: int):
        super().__init__()
        self.bits = bits
        self.steps = self.bytes_read = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        B, G, _, d = key_states.shape
        dev = key_states.device
        self.dtype, self.d = key_states.dtype, d
        groups = max(1, d // GROUP)
        width = d * self.bits // 8
        # codes, scales and zeros of K and V, each a chunk-grown row buffer
        self.bufs = {name: RowBuffer(B, G, w, dt, dev) for name, w, dt in (
            ("kq", width, torch.uint8), ("ks", groups, torch.float32), ("kz", groups, torch.float32),
            ("vq", width, torch.uint8), ("vs", groups, torch.float32), ("vz", groups, torch.float32))}
        self.is_initialized = True

    @torch.no_grad()
    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b = self.bufs
        for prefix, x in (("k", key_states), ("v", value_states)):
            q, s, z = quantize(x, self.bits)
            b[prefix + "q"].append(q)
            b[prefix + "s"].append(s)
            b[prefix + "z"].append(z)
        if key_states.shape[2] == 1:
            self.steps += 1
            self.bytes_read += sum(buf.valid().numel() * buf.data.element_size() for buf in b.values())
        K = dequantize(b["kq"].valid(), b["ks"].valid(), b["kz"].valid(), self.bits, self.dtype)
        V = dequantize(b["vq"].valid(), b["vs"].valid(), b["vz"].valid(), self.bits, self.dtype)
        return K, V

    def get_seq_length(self) -> int:
        return self.bufs["kq"].length if self.is_initialized else 0

    def row_buffers(self) -> list:
        return list(self.bufs.values())

    def reset(self) -> None:
        if self.is_initialized:
            for buf in self.bufs.values():
                buf.reset()

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.bufs.values()) if self.is_initialized else 0


class QuantCache(Rebatch):
    """`QuantCache(model, bits=4)`: all entries, a quarter (INT4) or half (INT8) of the bytes plus scales."""

    method = "quant"

    def __init__(self, model, bits: int = 4, **_):
        if bits not in (4, 8):
            raise ValueError(f"quant bits must be 4 or 8, got {bits}")
        d = model.config.head_dim
        if d % min(GROUP, d) or (bits == 4 and d % 2):
            raise ValueError(f"head size {d} does not split into quantization groups of {GROUP}")
        self.bits = bits
        super().__init__(layers=[QuantLayer(bits) for _ in range(model.config.n_layers)])

    def prefix_facts(self, model) -> dict:
        return {"bits": self.bits}

    @property
    def stats(self) -> dict:
        return read_stats(self.layers)
