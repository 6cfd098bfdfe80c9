"""A model's shape and kind, read from its checkpoint's config.json (a dict): everything our model classes
(transformer.py) need to build and run an architecture, as one frozen value. Reading it imports nothing but torch.

The field names follow the checkpoint's config where one exists; what an architecture fixes (Gemma's norm of
1 + w, OPT's learned positions) is derived here once, so the model's code branches on a fact, not a name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# model_type -> its name in the checkpoint's "architectures" (what a converted checkpoint's config.json says)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "opt": "OPTForCausalLM"}
SUPPORTED = tuple(sorted(ARCHITECTURES))


class UnsupportedModelError(ValueError):
    """The model's architecture (or one of its options) has no implementation here."""


@dataclass(frozen=True)
class Rope:
    """One RoPE: its base, and how its frequencies are stretched (rope_type "default", "linear" or "llama3")."""

    theta: float
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    dim: int  # D: the residual stream
    n_layers: int
    n_heads: int  # H
    n_kv_heads: int  # G
    head_dim: int  # d
    intermediate: int  # F: the MLP's hidden width
    norm_eps: float
    max_positions: int
    norm: str = "rms"  # "rms": x / rms(x) * w; "rms1p": ... * (1 + w) (Gemma); "layer": LayerNorm with bias (OPT)
    act: str = "silu"  # the MLP's activation: "silu", "gelu_tanh" (gated) or "relu" (OPT's fc1 -> fc2)
    qkv_bias: bool = False
    out_bias: bool = False  # o_proj's bias (OPT)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head norm of q and k before RoPE (Qwen3, Gemma 3)
    sandwich: bool = False  # each sublayer's output normed before its residual add (Gemma 3)
    embed_scale: float | None = None  # the input embedding multiplied by it (Gemma: sqrt(D))
    logit_softcap: float | None = None
    tie_embeddings: bool = False
    windows: tuple = ()  # each layer's sliding window (None: global attention)
    rope_types: tuple = ()  # each layer's RoPE (a key of ropes)
    ropes: tuple = ()  # ((key, Rope), ...); empty: no RoPE (OPT)
    score_scale: float = 0.0  # the factor on q.k (d^-0.5; Gemma: query_pre_attn_scalar^-0.5; OPT: 1, q pre-scaled)
    q_scale: float = 1.0  # the factor the model multiplies into q itself (OPT: d^-0.5)
    pre_norm: bool = True  # OPT 350m normalizes after each sublayer
    final_norm: bool = True
    position_offset: int = 0  # learned positions (OPT): the table's row of position p is p + offset; 0: none
    embed_dim: int = 0  # OPT's word_embed_proj_dim where it differs from dim (project_in / project_out)
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    pad_token_id: int | None = None

    @property
    def group(self) -> int:
        """r: query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    @property
    def rope(self) -> bool:
        return bool(self.ropes)

    @property
    def mixed(self) -> bool:
        """Layers attend over different windows (Gemma 3's local and global layers)."""
        return len(set(self.windows)) > 1


def _get(c: dict, *names, default=None):
    for n in names:
        if c.get(n) is not None:
            return c[n]
    return default


def _rope(p: dict | None, theta: float | None) -> Rope:
    p = dict(p or {})
    kind = p.get("rope_type") or p.get("type") or "default"
    theta = float(p.get("rope_theta") or theta or 10000.0)
    if kind == "default":
        return Rope(theta)
    if kind == "linear":
        return Rope(theta, "linear", float(p["factor"]))
    if kind == "llama3":
        return Rope(theta, "llama3", float(p["factor"]), float(p.get("low_freq_factor", 1.0)),
                    float(p.get("high_freq_factor", 4.0)), int(p.get("original_max_position_embeddings", 8192)))
    raise UnsupportedModelError(f"RoPE scaling {kind!r} is not supported (default, linear, llama3 are)")


def _ropes(c: dict, types: list[str]) -> tuple:
    """((key, Rope), ...) from either config layout: transformers 5's rope_parameters (one dict, or one per layer
    type), or rope_theta + rope_scaling (Gemma 3: rope_local_base_freq for its local layers)."""
    params = c.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        return tuple((t, _rope(params[t], None)) for t in dict.fromkeys(types))
    if isinstance(params, dict) and params:
        one = _rope(params, c.get("rope_theta"))
    else:
        one = _rope(c.get("rope_scaling"), c.get("rope_theta"))
    if c["model_type"] == "gemma3_text" and "sliding_attention" in types:
        local = Rope(float(c.get("rope_local_base_freq") or 10000.0))
        return tuple((t, local if t == "sliding_attention" else one) for t in dict.fromkeys(types))
    return tuple((t, one) for t in dict.fromkeys(types))


def _layer_types(c: dict, mt: str, n: int) -> list[str]:
    types = c.get("layer_types")
    if types:
        return list(types)
    if mt == "gemma3_text":  # older configs: every pattern-th layer global
        pattern = int(c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or 6)
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    if mt == "mistral" and c.get("sliding_window"):
        return ["sliding_attention"] * n
    return ["full_attention"] * n


def from_config(c: dict) -> ModelArgs:
    """The ModelArgs of a checkpoint's config (config.json as a dict; UnsupportedModelError for another
    architecture)."""
    mt = c.get("model_type")
    if mt == "gemma3":  # a multimodal Gemma 3's config: its text model
        c = {**c["text_config"], "model_type": "gemma3_text"}
        mt = "gemma3_text"
    if mt not in ARCHITECTURES:
        raise UnsupportedModelError(f"unsupported architecture {mt!r}: infinigen-kv supports {', '.join(SUPPORTED)}")
    D, H, L = int(c["hidden_size"]), int(c["num_attention_heads"]), int(c["num_hidden_layers"])
    G = int(_get(c, "num_key_value_heads", default=H))
    d = int(_get(c, "head_dim", default=D // H))
    ids = dict(bos_token_id=c.get("bos_token_id"), eos_token_id=c.get("eos_token_id"),
               pad_token_id=c.get("pad_token_id"))
    common = dict(model_type=mt, vocab_size=int(c["vocab_size"]), dim=D, n_layers=L, n_heads=H, n_kv_heads=G,
                  head_dim=d, max_positions=int(_get(c, "max_position_embeddings", default=0)),
                  tie_embeddings=bool(c.get("tie_word_embeddings", mt in ("gemma3_text", "opt"))), **ids)
    if mt == "opt":
        if c.get("activation_function", "relu") != "relu":
            raise UnsupportedModelError(f"OPT with activation {c['activation_function']!r} is not supported")
        before = bool(c.get("do_layer_norm_before", True))
        proj = int(_get(c, "word_embed_proj_dim", default=D))
        return ModelArgs(**common, intermediate=int(c["ffn_dim"]), norm_eps=1e-5, norm="layer", act="relu",
                         qkv_bias=bool(c.get("enable_bias", True)), out_bias=bool(c.get("enable_bias", True)),
                         mlp_bias=bool(c.get("enable_bias", True)), windows=(None,) * L, rope_types=(None,) * L,
                         score_scale=1.0, q_scale=d**-0.5, pre_norm=before,
                         final_norm=before and not c.get("_remove_final_layer_norm", False), position_offset=2,
                         embed_dim=proj if proj != D else 0)
    types = _layer_types(c, mt, L)
    window = c.get("sliding_window")
    windows = tuple(int(window) if t == "sliding_attention" and window else None for t in types)
    gemma = mt == "gemma3_text"
    act = c.get("hidden_activation") or c.get("hidden_act") or "silu"
    if act not in ("silu", "gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"MLP activation {act!r} is not supported (silu, gelu_pytorch_tanh are)")
    scale = float(c["query_pre_attn_scalar"]) ** -0.5 if gemma else d**-0.5
    if gemma and c.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError("attention logit soft-capping is not supported")
    return ModelArgs(
        **common, intermediate=int(c["intermediate_size"]), norm_eps=float(_get(c, "rms_norm_eps", default=1e-6)),
        norm="rms1p" if gemma else "rms", act="silu" if act == "silu" else "gelu_tanh",
        qkv_bias=bool(c.get("attention_bias", mt == "qwen2")), out_bias=bool(c.get("attention_bias", False)) and mt != "qwen2",
        mlp_bias=bool(c.get("mlp_bias", False)), qk_norm=mt in ("qwen3", "gemma3_text"), sandwich=gemma,
        embed_scale=math.sqrt(D) if gemma else None, logit_softcap=c.get("final_logit_softcapping"),
        windows=windows, rope_types=tuple(types) if gemma else (None,) * L,
        ropes=_ropes(c, types) if gemma else ((None, _ropes(c, ["full_attention"])[0][1]),),
        score_scale=scale)
