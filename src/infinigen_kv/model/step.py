"""A batch's decode step of our own, for the Llama-architecture models (llama, qwen2) on CPU: the decoder layers as
one flat loop over their weights, the `linear` kernel, the cache and the registered attention function, without
transformers' module machinery around them (the eager overhead of a batch-1 step: docs/BENCHMARKS.md, "Where a
step goes"). The same operations in the same order as the model's own forward: logits equal to the last bit
(tests/test_step.py), so every method and test means the same with it or without it.

Used by `generate` when `supports(model, cache)`; INFINIGEN_OWN_STEP=0 turns it off (the model's forward).
"""

from __future__ import annotations

import os

import torch

from . import kernels
from .arch import apply_rope, get_arch
from .attention import _attention
from .install import KERNEL_ROWS_BF16, _prefilling, _small_batch_linear

MODEL_TYPES = ("llama", "qwen2")  # one pre-norm residual layout, SiLU-gated MLP, no windows, no QK-norm
ENABLED = os.environ.get("INFINIGEN_OWN_STEP", "1") != "0"


def supports(model, cache) -> bool:
    """Whether `decode_step` serves this model and cache: a Llama-layout model on CPU in float32 with the fast
    linears installed (load_model on CPU), one of our caches (it speculates in `before_attention`)."""
    if not ENABLED or getattr(cache, "before_attention", None) is None:
        return False
    if not getattr(model, "_infinigen_phase_hook", False) or not getattr(model, "_infinigen_installed", False):
        return False
    arch = get_arch(model)
    p = next(model.parameters())
    return (arch.model_type in MODEL_TYPES and not arch.qk_norm and all(w is None for w in arch.windows)
            and p.device.type == "cpu" and p.dtype == torch.float32)


@torch.inference_mode()
def decode_step(model, cache, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """ids (B,) at positions (B, 1), mask (B, n + 1) of the padded past and this token (None: nothing padded)
    -> logits (B, V), the cache appended to, as model(input_ids=ids[:, None], ...) would."""
    _prefilling.set(False)  # the linears' decode path (a forward's pre-hook would set it)
    base = model.model
    x = base.embed_tokens(ids[:, None])  # (B, 1, D)
    cos, sin = base.rotary_emb(x, positions)  # (B, 1, d)
    mask4 = None if mask is None else mask[:, None, None, :].bool()  # (B, 1, 1, n + 1), True: attend
    B = ids.shape[0]
    kern = kernels.cpu() if B <= KERNEL_ROWS_BF16 else None  # the rows the linears' kernel path takes
    plans = _merged(model) if kern is not None else None
    if plans is not None and None not in plans:
        return _kernel_layers(model, cache, kern, x, (cos.contiguous(), sin.contiguous()), mask4, plans)
    for i, layer in enumerate(base.layers):
        a = layer.self_attn
        h = _norm(layer.input_layernorm, x)
        cache.before_attention(i, h, (cos, sin), mask4)  # what the self_attn pre-hook does
        shape = (B, 1, -1, a.head_dim)
        q, k, v = (_small_batch_linear(proj, h).view(shape).transpose(1, 2) for proj in (a.q_proj, a.k_proj, a.v_proj))
        q, k = apply_rope(q, (cos, sin)), apply_rope(k, (cos, sin))  # transformers' apply_rotary_pos_emb
        k, v = cache.update(k, v, i)
        out, _ = _attention(a, q, k, v, mask4, a.scaling, 0.0, infinigen_cache=cache)  # (B, 1, H, d)
        x = x + _small_batch_linear(a.o_proj, out.reshape(B, 1, -1).contiguous())
        h = _norm(layer.post_attention_layernorm, x)
        m = layer.mlp
        x = x + _small_batch_linear(m.down_proj, m.act_fn(_small_batch_linear(m.gate_proj, h)) * _small_batch_linear(m.up_proj, h))
    return _small_batch_linear(model.lm_head, _norm(base.norm, x))[:, -1]


def _kernel_layers(model, cache, kern, x, rope, mask4, plans) -> torch.Tensor:
    """The decoder layers of a few rows through the kernels, ~10 calls a layer: RMSNorm, q k v in one linear, RoPE
    of q and k in place, the cache and attention, o with the residual added, RMSNorm, gate and up in one linear,
    silu(gate) * up, down with the residual added. x (B, 1, D) -> logits (B, V); the same bits as the loop above
    (each kernel computes what the PyTorch ops it replaces compute, tests/test_step.py)."""
    base, B = model.model, x.shape[0]
    cos, sin = rope
    lanes = kernels.silu_lanes() if kernels.silu_mul_exact() else None
    x = x.view(B, -1)  # (B, D)
    for i, (layer, ((wqkv, bqkv, split), (wgu, half), (wo, bo), (wd, bd))) in enumerate(zip(base.layers, plans)):
        a = layer.self_attn
        d = a.head_dim
        nq, nk = split[0] // d, split[1] // d
        h = _norm(layer.input_layernorm, x)
        cache.before_attention(i, h.view(B, 1, -1), rope, mask4)  # what the self_attn pre-hook does
        qkv = kern.linear(h, wqkv, bqkv)  # (B, (H + 2G) d)
        kern.rope_(qkv, cos, sin, nq + nk)  # q and k rotated in place, as apply_rope
        qkv = qkv.view(B, 1, -1, d).transpose(1, 2)  # (B, H + 2G, 1, d)
        k, v = cache.update(qkv[:, nq : nq + nk], qkv[:, nq + nk :], i)
        out, _ = _attention(a, qkv[:, :nq], k, v, mask4, a.scaling, 0.0, infinigen_cache=cache)  # (B, 1, H, d)
        x = kern.linear(out.reshape(B, -1).contiguous(), wo, bo, x)  # x + o_proj(out)
        h = _norm(layer.post_attention_layernorm, x)
        gu = kern.linear(h, wgu, None)  # (B, 2F): gate, up
        if lanes is not None:
            act = kern.silu_mul(gu, lanes)
        else:
            act = layer.mlp.act_fn(gu[:, :half].contiguous()) * gu[:, half:]
        x = kern.linear(act, wd, bd, x)  # x + down_proj(act)
    return _small_batch_linear(model.lm_head, _norm(base.norm, x))


def _merged(model) -> list:
    """Per decoder layer, its q, k, v and its gate, up projections' bfloat16 decode weights as one matrix each, and
    o's and down's (or None where a layer has no such copies): ((W (Hd + 2Gd, D), bias or None, split sizes),
    (W (2F, D), F), (W_o, bias or None), (W_down, bias or None)).
    Made once per model; each projection's `weight_bf16` then becomes its rows of the merged matrix (a view: no
    memory more), so the model's forward reads the same bytes. The kernel computes each output row on its own,
    so one call over the merged rows gives every projection's outputs to the same bits as separate calls."""
    plan = getattr(model, "_infinigen_merged", None)
    if plan is None:
        plan = [_merge_layer(layer) for layer in model.model.layers]
        model._infinigen_merged = plan
    return plan


def _merge_layer(layer):
    a, m = layer.self_attn, layer.mlp
    qkv, gu = (a.q_proj, a.k_proj, a.v_proj), (m.gate_proj, m.up_proj)
    if any(getattr(p, "weight_bf16", None) is None for p in qkv + gu + (a.o_proj, m.down_proj)):
        return None
    if any(p.bias is not None for p in gu):
        return None  # (an MLP with biases keeps its separate calls)
    biases = [p.bias for p in qkv]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return None
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    out = [(p.weight_bf16, None if p.bias is None else p.bias.detach()) for p in (a.o_proj, m.down_proj)]
    return (_merge(qkv), bias, [p.out_features for p in qkv]), (_merge(gu), m.gate_proj.out_features), *out


def _merge(projs) -> torch.Tensor:
    """One matrix of the projections' bfloat16 weights, each projection's weight_bf16 made a view of its rows."""
    W = torch.cat([p.weight_bf16 for p in projs])
    start = 0
    for p in projs:
        p.weight_bf16 = W[start : start + p.out_features]
        start += p.out_features
    return W


def _norm(norm, x: torch.Tensor) -> torch.Tensor:
    """A Llama / Qwen2 RMSNorm of float32 x: the module's forward (the `rms_norm` kernel, fast_cpu_linears), called
    without the module machinery."""
    return norm.forward(x)
