"""The attention function every method here runs under (registered as "infinigen" by install.py), called
with the cache the pre-hook handed it as the `infinigen_cache` keyword.

- The attention function attends over the fetched working set with its per-(sequence, KV head) mask
  when the cache's layer has one, and is plain transformers sdpa otherwise, so a model with these
  hooks behaves exactly as before with any other cache. On CPU, with the kernels of kernels/cpu.cpp,
  a decode step attends in one pass: over InfiniGen's chosen rows where they lie in the pool (the layer's
  `fused` selection), or over a whole cache (`dense_kernel` layers: full, InfiniGen's layer 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import kernels

# SDPA backends on a GPU: all but cuDNN's, which builds a plan on the host for every new key length (a host-bound
# decode step spent a large share of its time there: docs/BENCHMARKS.md, "On a GPU")
GPU_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def infinigen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query (B, H, q, d); key/value (B, G, k, d). Returns (B, q, H, d) and no weights."""
    if query.is_cuda:
        with sdpa_kernel(GPU_SDPA):
            return _attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    return _attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)


def _attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    cache = kwargs.pop("infinigen_cache", None)
    layer = cache.layers[module.layer_idx] if cache is not None else None
    B, H, T, d = query.shape
    G = key.shape[1]
    # a cache of ours hands its layer (methods/base.LogicalLayer: its traits); another cache (DynamicCache) none
    if layer is None or not layer.working:
        first = layer.kv_offset if layer is not None else 0  # a sliding window's buffers begin at that position
        if first and attention_mask is not None:
            attention_mask = attention_mask[..., first : first + key.shape[2]]
        if layer is not None and layer.needs_probs and T > 1:  # H2O scores the prefill
            layer.add_prefill_scores(query, key, attention_mask, scaling)
        if T == 1 and layer is not None and layer.dense_kernel:
            out = _dense_kernel(layer, query, key, attention_mask, scaling)
            if out is not None:
                return out, None
        if T > 1 and (out := _prefill_by_row(module, query, key, value, attention_mask, scaling, kwargs)) is not None:
            return out, None
        return _sdpa(module, query, key, value, attention_mask, scaling, kwargs, dropout)
    q = query.reshape(B, G, H // G, d)  # one decode token: the r heads of a group act as r queries
    fused = layer.fused
    if fused is not None:  # the chosen rows, read where they lie in the pool (CPU kernel)
        idx, count, new = fused
        out = kernels.cpu().attend(q.float().contiguous(), key, value, idx, count,
                                   new if isinstance(new, torch.Tensor) else None,
                                   new if isinstance(new, int) else -1, None, 0, _scale(scaling, d), query.dtype)
    elif layer.needs_probs:  # H2O accumulates the weights: explicit softmax
        s = torch.matmul(q, key.transpose(-1, -2)) * scaling  # (B, G, r, m)
        p = torch.softmax(s.masked_fill(~layer.work_mask, float("-inf")).float(), dim=-1)
        layer.add_scores(p.sum(2))
        return torch.matmul(p.to(value.dtype), value).reshape(B, 1, H, d), None
    else:
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=layer.work_mask, scale=scaling)  # (B, G, r, d)
    if cache.track_recall:
        cache.record_recall(module.layer_idx, q, attention_mask, scaling)
    return out.reshape(B, 1, H, d), None


def _sdpa(module, query, key, value, attention_mask, scaling, kwargs, dropout=0.0):
    """transformers' sdpa attention. Several queries with a mask on CPU (a chunk over a past): the grouped-query
    heads by SDPA's `enable_gqa`, where transformers copies every K/V head r times (repeat_kv: ~200 ms of a 16-token
    chunk's ~380 ms over a 3.8k past here). The same bits (tests/test_attention.py). -> (B, T, H, d), None"""
    if (attention_mask is None or getattr(module, "num_key_value_groups", 1) == 1 or query.shape[2] == 1
            or not query.is_cpu or dropout or kwargs.get("softcap") is not None
            or kwargs.get("position_bias") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _scale(scaling, d: int) -> float:
    return float(scaling) if scaling is not None else d**-0.5


def _dense_kernel(layer, query, key, attention_mask, scaling):
    """A decode query over a whole CPU cache (full, InfiniGen's dense layer 0) with the CPU kernel, reading
    the K/V buffers in place; None when the kernel does not apply (other device, no kernel, a copy)."""
    buf_k, buf_v = layer.k.data, layer.v.data  # (B, G, capacity, d): the rows [0, n) are the cache
    n = key.shape[2]
    if (query.device.type != "cpu" or buf_k.device.type != "cpu" or key.data_ptr() != buf_k.data_ptr()
            or n != layer.k.length or not buf_k.is_contiguous()):
        return None
    kern = kernels.cpu()
    if kern is None:
        return None
    B, H, _, d = query.shape
    G = key.shape[1]
    keep = None
    if attention_mask is not None:
        m = attention_mask[:, :, -1:, :n]  # (B, 1, 1, n)
        keep = (m if m.dtype == torch.bool else m == 0).reshape(B, 1, n).contiguous()
    q = query.reshape(B, G, H // G, d).float().contiguous()
    out = kern.attend(q, buf_k, buf_v, None, None, None, -1, keep, n, _scale(scaling, d), query.dtype)
    return out.reshape(B, 1, H, d)


def _prefill_by_row(module, query, key, value, attention_mask, scaling, kwargs):
    """A fresh prefill of a left-padded batch, row by row over each row's own tokens, exactly as the row
    alone is computed: SDPA's blocking follows the padded length, so a row's numbers (and near-tie
    selections) would depend on its batch-mates. A row longer than the layer's sliding window attends inside
    it block by block (`_local_prefill`), a shorter one plain causal attention. (B, T, H, d), pad positions
    0; None where it does not apply (no mask: nothing padded; a past)."""
    T = query.shape[2]
    if attention_mask is None or attention_mask.dtype != torch.bool or key.shape[2] != T:
        return None
    window = getattr(module, "sliding_window", None) or kwargs.get("sliding_window")
    # each valid token attends to itself, whatever the window: the diagonal marks them (B, T)
    pads = (~attention_mask[:, 0].diagonal(dim1=-2, dim2=-1)).sum(-1).tolist()
    out = query.new_zeros(query.shape[0], T, query.shape[1], query.shape[3])
    for b, s in enumerate(pads):
        row = [t[b : b + 1, :, s:].contiguous() for t in (query, key, value)]
        if window and T - s > window:
            out[b, s:] = _local_prefill(module, *row, window, scaling, kwargs)[0]
        else:
            out[b, s:] = _sdpa(module, *row, None, scaling, kwargs)[0][0]
    return out


def _local_prefill(module, query, key, value, window: int, scaling, kwargs):
    """Sliding-window attention of a prompt (one row; query (1, H, T, d), key/value (1, G, T, d)), `window`
    queries at a time over the keys they can reach (query i sees keys i - window < j <= i, transformers'
    window): O(T W) work where the (T, T) mask costs O(T^2), ~8x fewer scores for Gemma 3 at 8k. -> (1, T, H, d)"""
    T = query.shape[2]
    out = query.new_empty(1, T, query.shape[1], query.shape[3])
    for a in range(0, T, window):
        b, lo = min(T, a + window), max(0, a - window + 1)
        qi = torch.arange(a, b, device=query.device).view(-1, 1)
        kj = torch.arange(lo, b, device=query.device).view(1, -1)
        mask = ((kj <= qi) & (kj > qi - window)).view(1, 1, b - a, b - lo)
        out[:, a:b] = _sdpa(module, query[:, :, a:b], key[:, :, lo:b], value[:, :, lo:b], mask, scaling, kwargs)[0]
    return out
