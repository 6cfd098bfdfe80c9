"""The bytes model: what one decode step must read (weights + the KV entries it touches)."""

from __future__ import annotations

from ..methods.base import cache_stats


def weight_bytes(model) -> int:
    """Bytes of the parameters a decode step reads (tied embeddings counted once: the LM head reads them
    every step; a linear layer with a bfloat16 copy for decode, `--dtype bf16-weights`, at 2 bytes each)."""
    decode_bytes = {m.weight.data_ptr(): m.weight_bf16.numel() * m.weight_bf16.element_size()
                    for m in model.modules() if getattr(m, "weight_bf16", None) is not None}
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += decode_bytes.get(p.data_ptr(), p.numel() * p.element_size())
    return total


def full_kv_bytes_per_step(model, batch: int, prompt_len: int, decode_steps: int) -> int:
    """KV bytes a full cache reads per decode step, averaged over the steps (for caches without stats)."""
    c = model.config
    H = c.num_attention_heads
    G = getattr(c, "num_key_value_heads", None) or H
    d = getattr(c, "head_dim", None) or c.hidden_size // H
    el = next(model.parameters()).element_size()
    mean_len = prompt_len + (decode_steps + 1) / 2
    return int(2 * batch * G * d * el * c.num_hidden_layers * mean_len)


def bytes_read_per_step(model, cache, batch: int, prompt_len: int, decode_steps: int) -> int:
    stats = cache_stats(cache)
    kv = stats.get("kv_bytes_per_step")
    if kv is None:
        kv = full_kv_bytes_per_step(model, batch, prompt_len, decode_steps)
    return weight_bytes(model) + int(kv)
