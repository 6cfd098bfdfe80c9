"""The bytes model: what one decode step must read (weights + the KV entries it touches)."""

from __future__ import annotations

from ..methods.base import cache_stats
from ..model.transformer import compute_dtype
from ..model.kv import kv_storage


def weight_bytes(model) -> int:
    """Bytes of the parameters a decode step reads, as held (tied embeddings counted once: the LM head reads them
    every step; bfloat16 weights at 2 bytes each)."""
    return sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in model.parameters()}.values())


def full_kv_bytes_per_step(model, batch: int, prompt_len: int, decode_steps: int) -> int:
    """KV bytes a full cache reads per decode step, averaged over the steps (for caches without stats)."""
    c = model.config
    G, d = c.n_kv_heads, c.head_dim
    p = next(model.parameters())
    el = kv_storage("auto", compute_dtype(model), p.device).itemsize  # the rows as the default stores them
    mean_len = prompt_len + (decode_steps + 1) / 2
    return int(2 * batch * G * d * el * c.n_layers * mean_len)


def bytes_read_per_step(model, cache, batch: int, prompt_len: int, decode_steps: int) -> int:
    stats = cache_stats(cache)
    kv = stats.get("kv_bytes_per_step")
    if kv is None:
        kv = full_kv_bytes_per_step(model, batch, prompt_len, decode_steps)
    return weight_bytes(model) + int(kv)
