"""The transformers side: a registered attention function and mask function named "infinigen", and a
forward pre-hook on every layer's self_attn.

- The pre-hook sees layer l's post-norm input, the RoPE (cos, sin), the mask and the cache. If the cache
  speculates (`before_attention`), it runs there, and the cache rides along to the attention function
  as the `infinigen_cache` keyword.
- The attention function attends over the fetched working set with its per-(sequence, KV head) mask
  when the cache's layer has one, and is plain transformers sdpa otherwise, so a model with these
  hooks behaves exactly as before with any other cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .adapters import get_arch

NAME = "infinigen"
HOOK_KWARGS = ("hidden_states", "position_embeddings", "attention_mask", "past_key_values")


def infinigen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query (B, H, q, d); key/value (B, G, k, d). Returns (B, q, H, d) and no weights."""
    cache = kwargs.pop("infinigen_cache", None)
    layer = cache.layers[module.layer_idx] if cache is not None else None
    if layer is None or not layer.working:
        if getattr(layer, "needs_probs", False) and query.shape[2] > 1:  # H2O scores the prefill
            layer.add_prefill_scores(query, key, attention_mask, scaling)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    B, H, _, d = query.shape
    G = key.shape[1]
    q = query.reshape(B, G, H // G, d)  # one decode token: the r heads of a group act as r queries
    if getattr(layer, "needs_probs", False):  # H2O accumulates the weights: explicit softmax
        s = torch.matmul(q, key.transpose(-1, -2)) * scaling  # (B, G, r, m)
        p = torch.softmax(s.masked_fill(~layer.work_mask, float("-inf")).float(), dim=-1)
        layer.add_scores(p.sum(2))
        return torch.matmul(p.to(value.dtype), value).reshape(B, 1, H, d), None
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=layer.work_mask, scale=scaling)  # (B, G, r, d)
    if getattr(cache, "track_recall", False):
        cache.record_recall(module.layer_idx, q, attention_mask, scaling)
    return out.reshape(B, 1, H, d), None


def _pre_hook(module, args, kwargs):
    cache = kwargs.get("past_key_values")
    speculate = getattr(cache, "before_attention", None)
    if speculate is None:
        return None
    speculate(module.layer_idx, kwargs["hidden_states"], kwargs.get("position_embeddings"),
              kwargs.get("attention_mask"))
    kwargs["infinigen_cache"] = cache
    return args, kwargs


def register() -> None:
    AttentionInterface.register(NAME, infinigen_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # without this, padding would be silently ignored


def install(model) -> None:
    """Hooks + attention implementation on `model`, once (idempotent)."""
    if getattr(model, "_infinigen_installed", False):
        return
    register()
    for attn in get_arch(model).attns:
        attn.register_forward_pre_hook(_pre_hook, with_kwargs=True)
    try:
        model.set_attn_implementation(NAME)
    except Exception:
        model.config._attn_implementation = NAME
    model._infinigen_installed = True
