"""Per-architecture facts: where the attention modules are, head layout, RoPE or not, query scaling.

Everything else in the package talks to a model through `Arch`, so adding an architecture means
teaching this file where its projections are and how its queries reach the attention kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

# model_type -> path of the decoder layers inside the *ForCausalLM module; all use `layer.self_attn`.
_LAYERS = {
    "llama": "model.layers",
    "mistral": "model.layers",
    "qwen2": "model.layers",
    "qwen3": "model.layers",  # q_norm / k_norm on each head before RoPE
    "opt": "model.decoder.layers",
    "gemma3_text": "model.layers",  # QK-norm; local (sliding-window) and global layers, a RoPE per layer type
}
SUPPORTED = tuple(sorted(_LAYERS))


class UnsupportedModelError(ValueError):
    """The model's architecture has no adapter here."""


@dataclass
class Arch:
    model_type: str
    attns: list[nn.Module]  # self_attn module of each layer
    num_heads: int  # H query heads
    num_kv_heads: int  # G key/value heads (G = H for multi-head attention)
    head_dim: int  # d
    hidden_size: int  # D
    rope: bool  # queries/keys rotated by RoPE between projection and score (not OPT)
    q_scale: float  # factor the model multiplies into q before attention (OPT pre-scales)
    score_scale: float  # factor the attention kernel applies to q.k (1.0 for OPT)
    qk_norm: bool = False  # per-head RMSNorm of q and k (attn.q_norm, attn.k_norm) before RoPE (Qwen3, Gemma 3)
    windows: list = field(default_factory=list)  # each layer's sliding window (None: global attention)
    rope_types: list | None = None  # each layer's RoPE type, where the model has one RoPE per type (Gemma 3)
    step: "StepInputs | None" = None  # what the current forward computed once for all layers (install's hooks)
    base: nn.Module | None = None  # the module that holds the layers and builds their masks

    @property
    def mixed(self) -> bool:
        """Whether layers attend over different windows (local and global layers): a layer's mask is then
        not the next layer's, and speculation builds the next layer's own (selection.layer_keep)."""
        return len(set(self.windows)) > 1

    def local(self, layer: int) -> bool:
        """A local layer: a sliding-window layer of a model that also has global layers (Gemma 3)."""
        return self.mixed and self.windows[layer] is not None

    def rope_for(self, layer: int, rope: tuple | None) -> tuple | None:
        """The (cos, sin) of `layer` in the current forward: `rope` (the calling layer's) unless the model
        rotates each layer type differently (Gemma 3: base 10k on local layers, 1M on global ones)."""
        if self.rope_types is None:
            return rope
        return self.step.ropes[self.rope_types[layer]]

    @property
    def num_layers(self) -> int:
        return len(self.attns)

    @property
    def group(self) -> int:
        """r: query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def query(self, layer: int, x: torch.Tensor, rope: tuple | None) -> torch.Tensor:
        """Queries of `layer` for inputs x (B, T, D), exactly as the attention kernel gets them: (B, H, T, d)."""
        attn = self.attns[layer]
        B, T, _ = x.shape
        q = attn.q_proj(x) * self.q_scale if self.q_scale != 1.0 else attn.q_proj(x)
        q = q.view(B, T, self.num_heads, self.head_dim)
        q = (attn.q_norm(q) if self.qk_norm else q).transpose(1, 2)
        return apply_rope(q, rope) if self.rope else q

    def key(self, layer: int, x: torch.Tensor, rope: tuple | None) -> torch.Tensor:
        """Keys of `layer` for inputs x (B, T, D), as the cache stores them (after RoPE): (B, G, T, d)."""
        B, T, _ = x.shape
        attn = self.attns[layer]
        k = attn.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        k = (attn.k_norm(k) if self.qk_norm else k).transpose(1, 2)
        return apply_rope(k, rope) if self.rope else k


class StepInputs:
    """What a forward (or a decode step, step.py) computes once and hands to its layers, kept for the speculation
    of the next layer: the attention mask the model was called with (2-D, 4-D, one per layer type, or None), for
    models with a RoPE per layer type each type's (cos, sin), and what the cache derives from them once for all
    layers (`memo`). Filled by hooks on the model (install.py) or by the decode step, cleared when it ends."""

    def __init__(self):
        self.mask = None
        self.ropes = {}
        self.memo = {}  # what a cache computes once for all layers of this forward (speculation's keep and caps)
        self.fetches = {}  # layer -> what an earlier layer's before_attention started for it (a Fetch), until its view
        self.column = None  # a static step's device column (1,) (model/static.py): shapes span the capacity

    def note_mask(self, module, args, kwargs) -> None:
        self.mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)

    def note_rope(self, module, args, kwargs, output) -> None:
        layer_type = args[2] if len(args) > 2 else kwargs.get("layer_type")
        self.ropes[layer_type] = output

    def clear(self, *_) -> None:
        self.mask, self.ropes, self.memo, self.fetches, self.column = None, {}, {}, {}, None


def step_inputs(model: nn.Module, base: nn.Module) -> StepInputs:
    """The model's StepInputs, its hooks registered once on `base`, the module that holds the layers and
    builds their masks (a *ForCausalLM calls it with the mask; so may a user)."""
    step = getattr(model, "_infinigen_step", None)
    if step is None:
        step = model._infinigen_step = StepInputs()
        base.register_forward_pre_hook(step.note_mask, with_kwargs=True)
        base.register_forward_hook(step.clear)
        rotary = getattr(base, "rotary_emb", None)
        if len(getattr(rotary, "layer_types", ())) > 1:
            rotary.register_forward_hook(step.note_rope, with_kwargs=True)
    return step


def apply_rope(x: torch.Tensor, rope: tuple) -> torch.Tensor:
    """Rotate x (B, heads, T, d) with the model's (cos, sin), each (B, T, d) (rotate-half layout)."""
    cos, sin = (t.unsqueeze(1) for t in rope)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def model_type_of(config) -> str:
    return getattr(config, "model_type", None) or type(config).__name__


def check_supported(config) -> None:
    mt = model_type_of(config)
    if mt not in _LAYERS:
        raise UnsupportedModelError(
            f"unsupported architecture {mt!r}: infinigen-kv supports {', '.join(SUPPORTED)}"
        )


def get_arch(model: nn.Module) -> Arch:
    """The adapter of a *ForCausalLM model (raises UnsupportedModelError for other architectures); reads the
    model, changes nothing (install.py hooks it)."""
    config = model.config
    check_supported(config)
    mt = model_type_of(config)
    base = model
    for name in _LAYERS[mt].split(".")[:-1]:
        base = getattr(base, name)
    layers = getattr(base, _LAYERS[mt].split(".")[-1])
    attns = [layer.self_attn for layer in layers]
    H = config.num_attention_heads
    G = getattr(config, "num_key_value_heads", None) or H
    d = getattr(config, "head_dim", None) or config.hidden_size // H
    step = getattr(model, "_infinigen_step", None)  # install() registers the hooks that fill it
    if mt == "opt":
        # OPT multiplies q by d^-0.5 itself and calls the kernel with scaling=1.0.
        return Arch(mt, attns, H, G, d, config.hidden_size, rope=False, q_scale=d**-0.5, score_scale=1.0,
                    windows=[None] * len(attns), step=step, base=base)
    # Mistral windows every layer by the config; the others name each layer's window (None: global)
    windows = [getattr(config, "sliding_window", None) if mt == "mistral" else getattr(a, "sliding_window", None)
               for a in attns]
    per_type = len(getattr(getattr(base, "rotary_emb", None), "layer_types", ())) > 1
    return Arch(mt, attns, H, G, d, config.hidden_size, rope=True, q_scale=1.0,
                score_scale=float(getattr(attns[0], "scaling", d**-0.5)),  # Gemma: query_pre_attn_scalar^-0.5
                qk_norm=hasattr(attns[0], "q_norm"), windows=windows,
                rope_types=list(config.layer_types) if per_type else None, step=step, base=base)
