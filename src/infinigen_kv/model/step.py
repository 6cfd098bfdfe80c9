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
import torch.nn.functional as F

from .arch import apply_rope, get_arch
from .attention import _attention
from .install import _prefilling, _small_batch_linear

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
    for i, layer in enumerate(base.layers):
        a = layer.self_attn
        h = _norm(layer.input_layernorm, x)
        cache.before_attention(i, h, (cos, sin), mask4)  # what the self_attn pre-hook does
        shape = (B, 1, -1, a.head_dim)
        q = _small_batch_linear(a.q_proj, h).view(shape).transpose(1, 2)  # (B, H, 1, d)
        k = _small_batch_linear(a.k_proj, h).view(shape).transpose(1, 2)  # (B, G, 1, d)
        v = _small_batch_linear(a.v_proj, h).view(shape).transpose(1, 2)
        q, k = apply_rope(q, (cos, sin)), apply_rope(k, (cos, sin))  # transformers' apply_rotary_pos_emb
        k, v = cache.update(k, v, i)
        out, _ = _attention(a, q, k, v, mask4, a.scaling, 0.0, infinigen_cache=cache)  # (B, 1, H, d)
        x = x + _small_batch_linear(a.o_proj, out.reshape(B, 1, -1).contiguous())
        h = _norm(layer.post_attention_layernorm, x)
        m = layer.mlp
        x = x + _small_batch_linear(m.down_proj, m.act_fn(_small_batch_linear(m.gate_proj, h))
                                    * _small_batch_linear(m.up_proj, h))
    return _small_batch_linear(model.lm_head, _norm(base.norm, x))[:, -1]


def _norm(norm, x: torch.Tensor) -> torch.Tensor:
    """A Llama / Qwen2 RMSNorm of float32 x as one fused op (the module computes the same in five: the same bits)."""
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
