"""Attention over a cache layer's view: `attend_layer` (the layer's `view` of the new k, v and what an earlier layer
fetched for it, attention over it, the recall diagnostic) and `attend` (the attention itself).

- A view (kv.py) that is a working set chosen for the step is attended with its own per-(sequence, KV head)
  mask; any other with the layer's mask (step.window_mask). On CPU, with the compiled kernels (kernels/), a decode
  step attends in one pass: over InfiniGen's chosen rows where they lie in the pool (`chosen`), or over a whole
  cache in place (`buffers`: full, InfiniGen's layer 0). On a GPU a decode query attends split over the keys
  (decode_attention.py: SDPA's kernels serve one query under a mask badly).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .decode_attention import decode_attention
from .kv import KVView, from_rows

# SDPA backends on a GPU: all but cuDNN's, which builds a plan on the host for every new key length (a host-bound
# decode step spent a large share of its time there: docs/BENCHMARKS.md, "On a GPU")
GPU_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
LONG_PAST = 1024  # keys before a prompt chunk from which a CPU row attends in bfloat16 products (_over_long_past)


def attend_layer(cache, i: int, q, k, v, mask, scaling: float, window, fetch, backend, at=None) -> torch.Tensor:
    """Layer i's new q (B, H, T, d), k, v (B, G, T, d) through the cache: its layer's view (which stores k, v;
    fetch: what an earlier layer's before_attention started for it; at: a static step's device column), attention
    over it (backend: the step's), and the recall diagnostic where the cache tracks it. -> (B, T, H, d)"""
    layer = cache.layers[i]
    view = layer.view(k, v, fetch) if at is None else layer.view(k, v, fetch, at)
    out, _ = attend(q, view, mask, scaling, backend, window)
    if view.selected and cache.track_recall:
        B, H, _, d = q.shape
        cache.record_recall(i, q.reshape(B, view.keys.shape[1], -1, d), view, mask, scaling)
    return out


def attend(query, view: KVView, attention_mask, scaling, backend, window=None):
    """query (B, H, q, d) over a cache layer's view, under the layer's mask (B, 1, q, k) bool or None (causal);
    backend: what runs it (model/backend.py; None: PyTorch's ops); window: the layer's sliding window. Returns
    (B, q, H, d) and no weights."""
    if query.is_cuda:
        with sdpa_kernel(GPU_SDPA):
            return _attention(query, view, attention_mask, scaling, window, None)
    return _attention(query, view, attention_mask, scaling, window, backend)


def _attention(query, view: KVView, attention_mask, scaling, window, backend):
    kern = backend.ops if backend is not None else None  # (None on a GPU)
    key, value = view.keys, view.values
    B, H, T, d = query.shape
    G = key.shape[1]
    if not view.selected:
        if view.offset and attention_mask is not None:  # a sliding window's buffers begin at that position
            attention_mask = attention_mask[..., view.offset : view.offset + key.shape[2]]
        if T == 1 and view.buffers is not None:
            out = _dense_kernel(view, query, attention_mask, scaling, backend)
            if out is not None:
                return out, None
        if T == 1 and split_decode(query):  # split over the keys
            mask = None if attention_mask is None else attention_mask[:, :, -1:, : key.shape[2]]
            out = decode_attention(query.reshape(B, G, H // G, d), key, value, mask, _scale(scaling, d))
            return out.reshape(B, 1, H, d), None
        if view.scores is not None and T > 1:  # H2O scores the prefill (bfloat16 rows read as they are)
            view.scores.add_prefill_scores(query, key if key.dtype != torch.int8 else from_rows(key, query.dtype),
                                           attention_mask, scaling, backend)
        reach = T + (window or key.shape[2]) - 1
        if T > 1 and key.shape[2] > reach:  # a window layer's prompt chunk over a past: the keys in its reach, the
            key, value = key[:, :, -reach:], value[:, :, -reach:]  # same whatever the cache keeps (a tee's first)
            attention_mask = attention_mask[..., -reach:] if attention_mask is not None else None
        # the stored rows as they are: a chunk over a long past is read by the CPU kernel without a float32 copy
        # of the whole past (2 KB a token a layer on Gemma 3, 1 KB on the 0.5B: a 32k prefill's peak memory)
        if T > 1 and (out := _prefill_by_row(query, key, value, attention_mask, scaling, window, backend)) is not None:
            return out, None
        key, value = _computed(query, key, value)
        return sdpa(query, key, value, attention_mask, scaling), None
    q = query.reshape(B, G, H // G, d)  # one decode token: the r heads of a group act as r queries
    if view.chosen is not None:  # the chosen rows, read where they lie in the pool (CPU kernel)
        idx, count, new = view.chosen
        out = kern.attend(q.float().contiguous(), key, value, idx, count, new if isinstance(new, torch.Tensor) else None,
                          new if isinstance(new, int) else -1, None, 0, _scale(scaling, d), query.dtype,
                          backend.attend_pairs_upto)
    elif view.scores is not None:  # H2O accumulates the weights: explicit softmax
        key, value = _computed(query, key, value)
        s = torch.matmul(q, key.transpose(-1, -2)) * scaling  # (B, G, r, m)
        p = torch.softmax(s.masked_fill(~view.mask, float("-inf")).float(), dim=-1)
        view.scores.add_scores(p.sum(2))
        return torch.matmul(p.to(value.dtype), value).reshape(B, 1, H, d), None
    elif split_decode(query):  # int8 rows crossed to the device as they are stored, and are read where they lie
        out = decode_attention(q, key, value, view.mask, _scale(scaling, d))  # (B, G, r, d)
    elif kern is not None and key.is_cpu and key.is_contiguous() and value.is_contiguous():
        # a gathered working set (B, G, m, d) on CPU: the kernel's dense pass, as over a whole cache (offload's,
        # whose rows lie in the full cache's order, then gets the full cache's bits)
        m = key.shape[2]
        keep = None if view.mask is None else view.mask.reshape(B, -1, m).contiguous()
        out = kern.attend(q.float().contiguous(), key, value, None, None, None, -1, keep, m, _scale(scaling, d),
                          query.dtype, backend.attend_pairs_upto)
    else:
        key, value = _computed(query, key, value)
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=view.mask, scale=scaling)  # (B, G, r, d)
    return out.reshape(B, 1, H, d), None


def split_decode(query) -> bool:
    """Whether a decode query attends through decode_attention (on a GPU)."""
    return query.is_cuda


def _computed(query, key, value):
    """K/V stored in another dtype than the query's (kv_dtype) in the query's, for PyTorch's attention (the CPU
    kernels read the stored rows as they are)."""
    if key.dtype == query.dtype:
        return key, value
    return from_rows(key, query.dtype), from_rows(value, query.dtype)


def sdpa(query, key, value, mask, scaling) -> torch.Tensor:
    """PyTorch's SDPA: query (B, H, T, d) over key/value (B, G, S, d) (grouped-query heads by `enable_gqa`, no copy
    of each K/V head r times), under mask (B, 1, T, S) bool, or causal where it is None and T > 1 (then over the
    first T keys: a prompt without a past). -> (B, T, H, d)"""
    B, H, T, d = query.shape
    G = key.shape[1]
    if T == 1 and G != H:  # one query: a group's r heads act as r queries of its K/V head (no copy of them)
        out = F.scaled_dot_product_attention(query.reshape(B, G, H // G, d), key, value, attn_mask=mask, scale=scaling)
        return out.reshape(B, 1, H, d)
    causal = mask is None and T > 1
    if causal and key.shape[2] > T:
        key, value = key[:, :, :T], value[:, :, :T]
    if mask is not None and G != H and repeat_groups(query):
        key, value = (t.repeat_interleave(H // G, dim=1) for t in (key, value))
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, is_causal=causal,
                                         enable_gqa=H != key.shape[1])
    return out.transpose(1, 2).contiguous()


def repeat_groups(query) -> bool:
    """Whether a masked chunk of grouped heads attends with its K/V heads repeated (B, H, S, d), as transformers does:
    on a GPU, where PyTorch's memory-efficient kernel takes a mask but not grouped heads, its flash kernel grouped
    heads but no mask, and its math kernel both at (B, H, T, S) float32 scores (8 GiB for a 2k chunk over 32k)."""
    return query.is_cuda


def _scale(scaling, d: int) -> float:
    return float(scaling) if scaling is not None else d**-0.5


def _dense_kernel(view: KVView, query, attention_mask, scaling, backend):
    """A decode query over a whole CPU cache (full, InfiniGen's dense layer 0) with the CPU kernel, reading the
    view's buffers in place; None when the kernel does not apply (other device, no kernel, keys not a prefix of
    the buffers)."""
    buf_k, buf_v = view.buffers  # (B, G, capacity, d): the rows [0, n) are the keys
    key = view.keys
    n = key.shape[2]
    if (query.device.type != "cpu" or buf_k.device.type != "cpu" or key.data_ptr() != buf_k.data_ptr()
            or key.stride() != buf_k.stride() or not buf_k.is_contiguous()):
        return None
    kern = backend.ops if backend is not None else None
    if kern is None:
        return None
    B, H, _, d = query.shape
    G = key.shape[1]
    keep = None
    if attention_mask is not None:
        m = attention_mask[:, :, -1:, :n]  # (B, 1, 1, n)
        keep = (m if m.dtype == torch.bool else m == 0).reshape(B, 1, n).contiguous()
    q = query.reshape(B, G, H // G, d).float().contiguous()
    out = kern.attend(q, buf_k, buf_v, None, None, None, -1, keep, n, _scale(scaling, d), query.dtype,
                      backend.attend_pairs_upto)
    return out.reshape(B, 1, H, d)


def _prefill_by_row(query, key, value, attention_mask, scaling, window, backend):
    """A prompt chunk of a left-padded batch, row by row over each row's own tokens, exactly as the row alone is
    computed: SDPA's blocking follows the padded length, so a row's numbers (and near-tie selections) would depend
    on its batch-mates. Without a past, a row longer than the layer's sliding window attends inside it block by
    block (`_local_prefill`), a shorter one plain causal attention; over a past (a later chunk: generation.prefill),
    a row attends its own keys under the model's mask. (B, T, H, d), pad positions 0; None where it does not apply
    (no mask: nothing padded; a sliding-window layer over a past)."""
    T, S = query.shape[2], key.shape[2]
    past = S - T
    if attention_mask is None or attention_mask.dtype != torch.bool:
        return None
    if past and window:
        return None
    m = attention_mask[:, 0]  # (B, T, S)
    # each valid token attends to itself, whatever the window: the diagonal marks them (B, T)
    pads = (~m[..., past:].diagonal(dim1=-2, dim2=-1)).sum(-1).tolist()
    # a global layer's last query sees every valid key: the padding keys are those it does not (B,)
    key_pads = (~m[:, -1]).sum(-1).tolist() if past else pads
    out = query.new_zeros(query.shape[0], T, query.shape[1], query.shape[3])
    for b, (s, k0) in enumerate(zip(pads, key_pads)):
        if s == T:  # all padding (a chunk before the row's first token)
            continue
        row = [query[b : b + 1, :, s:].contiguous()] + [t[b : b + 1, :, k0:] for t in (key, value)]
        if k0 < past + s and (long := _over_long_past(*row, scaling, backend)) is not None:  # the row's own past: its keys
            out[b, s:] = long  # under the model's mask, as the row alone has them (in bfloat16 products)
            continue
        row[1:] = [t.contiguous() for t in _computed(query, *row[1:])]
        if k0 < past + s:
            out[b, s:] = sdpa(*row, m[b : b + 1, None, s:, k0:].contiguous(), scaling)[0]
        elif window and T - s > window:
            out[b, s:] = _local_prefill(*row, window, scaling)[0]
        else:
            out[b, s:] = sdpa(*row, None, scaling)[0]
    return out


def _over_long_past(query, key, value, scaling, backend):
    """One row's chunk query (1, H, T, d) over its keys (1, G, S, d) (float32 or bfloat16 rows), the last T its own
    (causal: the model's mask of a left-padded row once its padding is cut), in the CPU kernel of bfloat16 products
    (kernels/prefill.cpp) where the past is long (LONG_PAST keys or more: there it is most of a prefill's arithmetic;
    3.3-4.2x PyTorch's float32 attention at 4k-32k, docs/BENCHMARKS.md). -> (T, H, d), or None: not on CPU, a short
    past, no kernel (no AVX-512 BF16), d no multiple of 64, int8 rows."""
    T, d = query.shape[2], query.shape[3]
    if (query.is_cuda or key.shape[2] - T < LONG_PAST or d % 64 or query.dtype != torch.float32
            or key.dtype not in (torch.float32, torch.bfloat16)):
        return None
    if backend is None or not backend.bf16_attention:
        return None
    return backend.ops.prefill_attend(query[0].transpose(0, 1), key[0].contiguous(), value[0].contiguous(),
                                      _scale(scaling, d))


def _local_prefill(query, key, value, window: int, scaling):
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
        out[:, a:b] = sdpa(query[:, :, a:b], key[:, :, lo:b], value[:, :, lo:b], mask, scaling)
    return out
