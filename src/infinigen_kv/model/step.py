"""The decode step: one token per sequence through the decoder layers as one flat loop over their weights, the
cache and the registered attention function, without transformers' module machinery around them (the eager
overhead of a batch-1 step: docs/BENCHMARKS.md, "Where a step goes"). Every decode loop runs it: `generate`, the
server's running batch (`runtime/batching.py`), `bench speed`. The same operations in the same order as the model's
own forward, so the logits are equal to the last bit (tests/test_step.py): every method and test means the same
with it or without it.

Two paths: on CPU in float32 with the fast linears (load_model on CPU), Llama-layout models (KERNEL_TYPES) run
~10 kernel calls a layer (`_kernel_layers`); every other model, device and dtype runs the same loop in PyTorch ops
and the model's own modules (`_layers`, a decoder-layer layout per architecture in LAYOUTS). What runs through
transformers' forward instead is in FORWARD, with the reason; INFINIGEN_OWN_STEP=0 sends every step there.
"""

from __future__ import annotations

import os

import torch

from . import backend as backends
from .attention import attend_layer, attention_block
from .kv import StepCache
from .install import SMALL_BATCH, _prefilling, _small_batch_linear, compute_dtype, install

KERNEL_TYPES = ("llama", "mistral", "qwen2")  # one pre-norm residual layout, SiLU-gated MLP, no QK-norm
ENABLED = os.environ.get("INFINIGEN_OWN_STEP", "1") != "0"
# What decodes through transformers' forward, and why (every architecture of arch.SUPPORTED runs the step).
FORWARD = {
    "a cache not made here (transformers' DynamicCache...)": "the step calls the cache's speculation hook itself",
    "layers spread over devices (device_map)": "accelerate moves activations between devices in its module hooks",
}


def forward_reason(model, cache) -> str | None:
    """The FORWARD entry that keeps this model and cache off the step (None: the step serves them)."""
    if not isinstance(cache, StepCache):
        return next(iter(FORWARD))
    if len({str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}) > 1:
        return list(FORWARD)[1]
    return None


def supports(model, cache) -> bool:
    """Whether `decode_step` serves this model and cache (the model's architecture is one arch.py adapts)."""
    if not ENABLED or not getattr(model, "_infinigen_installed", False):
        return False
    return forward_reason(model, cache) is None


def decode(model, cache, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
           own: bool | None = None) -> torch.Tensor:
    """The next logits (B, V) after ids (B,) at positions (B, 1), mask (B, n + 1) of the padded past and this token
    (None: nothing padded): every decode loop's one step (generate, the server's running batch, bench speed).
    `decode_step` where it serves the model and cache (own: `supports`, when the caller has asked once), else the
    model's forward (the same logits)."""
    if own if own is not None else supports(model, cache):
        return decode_step(model, cache, ids, positions, mask)
    return model(input_ids=ids[:, None], attention_mask=mask, position_ids=positions, past_key_values=cache,
                 use_cache=True).logits[:, -1]


@torch.inference_mode()
def decode_step(model, cache, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                at: torch.Tensor | None = None) -> torch.Tensor:
    """ids (B,) at positions (B, 1), mask (B, n + 1) of the padded past and this token (None: nothing padded)
    -> logits (B, V), the cache appended to, as model(input_ids=ids[:, None], ...) would. A static step
    (model/static.py): mask (B, capacity) marks the valid columns and at (1,) is the column the new rows go to."""
    _prefilling.set(False)  # the linears' decode path (a forward's pre-hook would set it)
    arch = install(model)  # (installed: supports)
    base, B = arch.base, ids.shape[0]
    masks = _masks(arch, mask, B, cache.get_seq_length() + 1)
    inputs = arch.step  # what speculation reads of the step (StepInputs): the model's mask, each layer type's RoPE
    inputs.mask, inputs.column = mask, at
    try:
        x = base.embed_tokens(ids[:, None])  # (B, 1, D)
        if arch.model_type == "opt":
            x = _opt_embed(base, x, positions)
            ropes = None
        elif arch.rope_types is not None:  # a RoPE per layer type (Gemma 3): the rotary hook notes each (arch.step)
            ropes = {t: base.rotary_emb(x, positions, t) for t in dict.fromkeys(arch.rope_types)}
        else:
            ropes = {None: base.rotary_emb(x, positions)}  # (B, 1, d) each
        fast = getattr(model, "_infinigen_phase_hook", False)  # the fast linears are installed
        backend = backends.for_device(x.device)
        kernel_path = fast and backend.kernels and arch.model_type in KERNEL_TYPES and compute_dtype(model) == torch.float32
        plans = _merged(model) if kernel_path and B <= SMALL_BATCH else None
        if plans is not None and None not in plans:
            rope = tuple(t.contiguous() for t in ropes[None])
            return _kernel_layers(model, arch, cache, backend, x, rope, masks, plans, at)
        return _logits(model, arch, _layers(arch, cache, x, ropes, masks, at))
    finally:
        inputs.clear()


def _masks(arch, mask: torch.Tensor | None, B: int, N: int) -> dict:
    """Each window's decode mask (B, 1, 1, N) bool over the N = n + 1 positions (True: attend) as transformers
    builds it for the layers with that window (None: global layers): None where it builds none (nothing padded and,
    for a window, fewer positions than it spans)."""
    pad = None if mask is None else mask[:, None, None, :].bool()
    out = {}
    for w in dict.fromkeys(arch.windows):
        if w is None or (pad is None and N < w):
            out[w] = pad
            continue
        inside = (torch.arange(N, device=arch.base.embed_tokens.weight.device) > N - 1 - w).view(1, 1, 1, N)
        out[w] = inside.expand(B, 1, 1, N) if pad is None else pad & inside
    return out


def _layers(arch, cache, x: torch.Tensor, ropes: dict | None, masks: dict, at=None) -> torch.Tensor:
    """The decoder layers in PyTorch ops and the model's own modules, each by its architecture's layout: x (B, 1, D)."""
    layout = LAYOUTS[arch.model_type]
    for i, layer in enumerate(arch.base.layers):
        rope = None if ropes is None else ropes[arch.rope_types[i] if arch.rope_types is not None else None]
        x = layout(layer, x, lambda h: attention_block(arch, cache, i, h, rope, masks[arch.windows[i]], at))
    return x


def _pre_norm(layer, x, attend):
    """Llama, Mistral, Qwen2, Qwen3: x + attn(norm(x)), then x + mlp(norm(x))."""
    x = x + attend(_norm(layer.input_layernorm, x))
    return x + layer.mlp(_norm(layer.post_attention_layernorm, x))


def _gemma3(layer, x, attend):
    """Gemma 3: each sublayer's output normed too before its residual add."""
    x = x + layer.post_attention_layernorm(attend(layer.input_layernorm(x)))
    return x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))


def _opt(layer, x, attend):
    """OPT: LayerNorms before (most sizes) or after (350m) each sublayer, a ReLU MLP of fc1, fc2."""
    pre = layer.do_layer_norm_before
    x = x + attend(layer.self_attn_layer_norm(x) if pre else x)
    if not pre:
        x = layer.self_attn_layer_norm(x)
    h = layer.final_layer_norm(x) if pre else x
    x = x + layer.fc2(layer.activation_fn(layer.fc1(h)))
    return x if pre else layer.final_layer_norm(x)


LAYOUTS = {"llama": _pre_norm, "mistral": _pre_norm, "qwen2": _pre_norm, "qwen3": _pre_norm, "gemma3_text": _gemma3,
           "opt": _opt}


def _opt_embed(base, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """OPT's input: token embeddings (projected in where the model has it) plus learned position embeddings."""
    if base.project_in is not None:
        x = base.project_in(x)
    return x + base.embed_positions(None, 0, position_ids=positions)


def _logits(model, arch, x: torch.Tensor) -> torch.Tensor:
    """The final norm and the LM head: x (B, 1, D) -> logits (B, V)."""
    base = arch.base
    if arch.model_type == "opt":
        x = base.final_layer_norm(x) if base.final_layer_norm is not None else x
        x = base.project_out(x) if base.project_out is not None else x
    else:
        x = _norm(base.norm, x)
    logits = model.lm_head(x)[:, -1]
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap is not None else logits


def _kernel_layers(model, arch, cache, backend, x, rope, masks, plans, at=None) -> torch.Tensor:
    """The decoder layers of a few rows through the kernels, ~10 calls a layer: RMSNorm, q k v in one linear, RoPE
    of q and k in place, the cache and attention, o with the residual added, RMSNorm, gate and up in one linear,
    silu(gate) * up, down with the residual added. x (B, 1, D) -> logits (B, V); the same bits as `_layers`
    (each kernel computes what the PyTorch ops it replaces compute, tests/test_step.py)."""
    base, B = model.model, x.shape[0]
    cos, sin = rope
    kern, lanes = backend.ops, backend.silu_lanes
    x = x.view(B, -1)  # (B, D)
    for i, (layer, ((wqkv, bqkv, split), (wgu, half), (wo, bo), (wd, bd))) in enumerate(zip(base.layers, plans)):
        a = layer.self_attn
        d = a.head_dim
        nq, nk = split[0] // d, split[1] // d
        h = _norm(layer.input_layernorm, x)
        mask4 = masks[arch.windows[i]]
        arch.step.fetches.update(cache.before_attention(i, h.view(B, 1, -1), rope, mask4))  # the next layer's fetch
        qkv = kern.linear(h, wqkv, bqkv)  # (B, (H + 2G) d)
        kern.rope_(qkv, cos, sin, nq + nk)  # q and k rotated in place, as apply_rope
        qkv = qkv.view(B, 1, -1, d).transpose(1, 2)  # (B, H + 2G, 1, d)
        out = attend_layer(a, cache, i, qkv[:, :nq], qkv[:, nq : nq + nk], qkv[:, nq + nk :], mask4, a.scaling,
                           arch.windows[i], arch.step.fetches.pop(i, None), at)  # (B, 1, H, d)
        x = kern.linear(out.reshape(B, -1).contiguous(), wo, bo, x)  # x + o_proj(out)
        h = _norm(layer.post_attention_layernorm, x)
        gu = kern.linear(h, wgu, None)  # (B, 2F): gate, up
        if lanes is not None:
            act = kern.silu_mul(gu, lanes)
        else:
            act = layer.mlp.act_fn(gu[:, :half].contiguous()) * gu[:, half:]
        x = kern.linear(act, wd, bd, x)  # x + down_proj(act)
    return _small_batch_linear(model.lm_head, _norm(base.norm, x))


def prepare(model) -> None:
    """What the decode step builds once for a model, built now (load_model calls it): the merged matrices of the
    kernel path, so a short command's first steps do no one-time work."""
    if getattr(model, "_infinigen_phase_hook", False) and backends.for_device(model.device).kernels:
        if model.config.model_type in KERNEL_TYPES and compute_dtype(model) == torch.float32:
            _merged(model)


def _merged(model) -> list:
    """Per decoder layer, its q, k, v and its gate, up projections' weights as one matrix each, and o's and
    down's (or None where a layer's weights are not all bfloat16 or all int8 rows): ((W (Hd + 2Gd, D), bias or None, split sizes),
    (W (2F, D), F), (W_o, bias or None), (W_down, bias or None)).
    Made once per model, when the model loads (prepare); each projection's weight then becomes its rows of the
    merged matrix (a view: the weights stay one copy), so the model's forward reads the same bytes. The kernel
    computes each output row on its own, so one call over the merged rows gives every projection's outputs to the
    same bits as separate calls."""
    plan = getattr(model, "_infinigen_merged", None)
    if plan is None:
        plan = [_merge_layer(layer) for layer in model.model.layers]
        model._infinigen_merged = plan
    return plan


def _merge_layer(layer):
    a, m = layer.self_attn, layer.mlp
    qkv, gu = (a.q_proj, a.k_proj, a.v_proj), (m.gate_proj, m.up_proj)
    if {p.weight.dtype for p in qkv + gu + (a.o_proj, m.down_proj)} not in ({torch.bfloat16}, {torch.int8}):
        return None
    if any(p.bias is not None for p in gu):
        return None  # (an MLP with biases keeps its separate calls)
    biases = [p.bias for p in qkv]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return None
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    out = [(p.weight.detach(), None if p.bias is None else p.bias.detach()) for p in (a.o_proj, m.down_proj)]
    return (_merge(qkv), bias, [p.out_features for p in qkv]), (_merge(gu), m.gate_proj.out_features), *out


def _merge(projs) -> torch.Tensor:
    """One matrix of the projections' weights, each projection's weight made a view of its rows."""
    W = torch.cat([p.weight.detach() for p in projs])
    start = 0
    for p in projs:
        p.weight = torch.nn.Parameter(W[start : start + p.out_features], requires_grad=False)
        start += p.out_features
    return W


def _norm(norm, x: torch.Tensor) -> torch.Tensor:
    """A Llama / Qwen2 RMSNorm of float32 x: the module's forward (the `rms_norm` kernel, fast_cpu_linears), called
    without the module machinery."""
    return norm.forward(x)
