"""Which past positions a decode token may attend (left padding, user masks, a layer's sliding window): the
`keep` mask every selecting method (InfiniGen's speculation, offload, h2o, streaming) applies.
"""

from __future__ import annotations

import torch


def valid_keys(mask, length: int, device=None) -> torch.Tensor | None:
    """(B, length) bool: the key positions the model's attention mask leaves attendable (False: padding,
    user-masked), from the mask the model was called with: 2-D (B, >= length) of 0/1, 4-D (B, 1, q, k) bool
    or additive float (its last query's row), or one per layer type (the global layers'); None: no mask."""
    if isinstance(mask, dict):
        mask = mask.get("full_attention")
    if mask is None:
        return None
    m = mask[:, 0, -1, :length] if mask.dim() == 4 else mask[:, :length]
    m = m if m.dtype == torch.bool else (m == 0 if mask.dim() == 4 else m != 0)
    return m.to(device or m.device, non_blocking=True)


def keep_source(arch, step, layer: int):
    """The mask a decode step reads its keep from: the calling layer's own (None: nothing is masked), which is
    also the next layer's where every layer has the same window; where local and global layers differ, the mask
    the model was called with (the window is applied per layer). step: the forward's step.Step."""
    attention_mask = step.layer_mask(layer)
    if attention_mask is None or not arch.mixed:
        return attention_mask
    return step.mask


def layer_keep(arch, layer: int, mask, n: int, B: int, device=None) -> torch.Tensor | None:
    """(B, 1, n) bool: the past positions 0..n-1 that layer `layer`'s decode token (position n) may attend,
    from the step's keep_source `mask`: not masked there and, for a model of local and global layers,
    inside the layer's own sliding window if it has one (a key within W - 1 positions of the query, as
    transformers' window); None when every position may be."""
    keep = valid_keys(mask, n, device)
    window = arch.windows[layer] if arch.mixed else None  # otherwise the layer's mask holds the window
    if window is not None and n - window + 1 > 0:
        keep = torch.ones(B, n, dtype=torch.bool, device=device) if keep is None else keep.clone()
        keep[:, : n - window + 1] = False
    return None if keep is None else keep.unsqueeze(1)
