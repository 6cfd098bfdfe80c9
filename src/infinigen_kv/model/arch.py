"""Per-architecture facts the caches and speculation read of a model: head layout, RoPE or not, query scaling,
windows, and each layer's attention module (its q and k projections, `query`, `key`). Built once from our model
(transformer.Transformer) and read, never written: what one step computes is a step.Step, passed down.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from .hparams import UnsupportedModelError  # noqa: F401 (callers import it from here)


@dataclass(frozen=True)
class Arch:
    model_type: str
    attns: list  # each layer's attention module (transformer.Attention)
    num_heads: int  # H query heads
    num_kv_heads: int  # G key/value heads (G = H for multi-head attention)
    head_dim: int  # d
    hidden_size: int  # D
    rope: bool  # queries/keys rotated by RoPE between projection and score (not OPT)
    q_scale: float  # factor the model multiplies into q before attention (OPT pre-scales)
    score_scale: float  # factor the attention kernel applies to q.k (1.0 for OPT)
    qk_norm: bool = False  # per-head norm of q and k before RoPE (Qwen3, Gemma 3)
    windows: list = field(default_factory=list)  # each layer's sliding window (None: global attention)
    rope_types: list | None = None  # each layer's RoPE key, where the model has one RoPE per layer type (Gemma 3)

    @property
    def mixed(self) -> bool:
        """Whether layers attend over different windows (local and global layers): a layer's mask is then
        not the next layer's, and speculation builds the next layer's own (keep.layer_keep)."""
        return len(set(self.windows)) > 1

    def local(self, layer: int) -> bool:
        """A local layer: a sliding-window layer of a model that also has global layers (Gemma 3)."""
        return self.mixed and self.windows[layer] is not None

    @property
    def num_layers(self) -> int:
        return len(self.attns)

    @property
    def group(self) -> int:
        """r: query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def query(self, layer: int, x: torch.Tensor, rope: tuple | None, backend) -> torch.Tensor:
        """Queries of `layer` for inputs x (B, T, D), exactly as attention gets them: (B, H, T, d)."""
        return self.attns[layer].query(x, rope, backend)

    def key(self, layer: int, x: torch.Tensor, rope: tuple | None, backend) -> torch.Tensor:
        """Keys of `layer` for inputs x (B, T, D), as the cache stores them (after RoPE): (B, G, T, d)."""
        return self.attns[layer].key(x, rope, backend)


_ARCHS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its Arch, made once


def get_arch(model: nn.Module) -> Arch:
    """The facts of our model (made once per model, kept beside it)."""
    arch = _ARCHS.get(model)
    if arch is not None:
        return arch
    if not hasattr(model, "args"):
        raise UnsupportedModelError(f"{type(model).__name__} is not a model of this package: load it with "
                                    "infinigen_kv.load_model (or infinigen_kv.from_hf for a transformers model)")
    a = model.args
    arch = Arch(a.model_type, [b.attn for b in model.layers], a.n_heads, a.n_kv_heads, a.head_dim, a.dim, a.rope,
                a.q_scale, a.score_scale, a.qk_norm, list(a.windows),
                list(a.rope_types) if len({r for r in a.rope_types}) > 1 else None)
    _ARCHS[model] = arch
    return arch
