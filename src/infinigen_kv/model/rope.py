"""RoPE: the frequencies of a model's rotary embedding (stretched as its config says) and the rotation itself."""

from __future__ import annotations

import torch

from .hparams import Rope


def apply_rope(x: torch.Tensor, rope: tuple) -> torch.Tensor:
    """Rotate x (B, heads, T, d) with (cos, sin), each (B, T, d) (rotate-half layout)."""
    cos, sin = (t.unsqueeze(1) for t in rope)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def inv_freq(rope: Rope, d: int) -> torch.Tensor:
    """(d/2,) float32: the RoPE frequencies, stretched as the rope's kind says (transformers' formulas)."""
    f = 1.0 / (rope.theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if rope.kind == "linear":
        return f / rope.factor
    if rope.kind == "llama3":
        low = rope.original_context / rope.low_freq_factor
        high = rope.original_context / rope.high_freq_factor
        wavelen = 2 * torch.pi / f
        scaled = torch.where(wavelen > low, f / rope.factor, f)
        smooth = (rope.original_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high) * ~(wavelen > low)
        return torch.where(medium, smoothed, scaled)
    return f

