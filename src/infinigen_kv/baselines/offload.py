"""`offload`: full offload, FlexGen-style. Every layer's whole K/V lives in the host pool (pinned when a GPU
computes) and is brought to the compute device at every decode step, the next layer's while this one
computes: InfiniGen's cache and transfer machinery with the selection replaced by "every valid row" and
no calibration or partial keys. Layer 0 has no previous layer: it fetches itself in its own pre-hook. On
CPU it degenerates to one copy of the whole cache per step (what offloading costs where there is no
device to offload from)."""

from __future__ import annotations

import torch

from ..cache import InfiniGenCache, past_keep


class OffloadCache(InfiniGenCache):
    method = "offload"
    speculates = False

    def __init__(self, model, **_):
        super().__init__(model)
        self._all = {}  # device -> (idx, real) of the current step, shared by every layer on that device

    @torch.no_grad()
    def before_attention(self, layer_idx: int, x: torch.Tensor, rope, attention_mask) -> None:
        if x.shape[1] != 1:
            return  # prefill attends over the prompt itself
        if layer_idx == 0:
            self._all = {}
            self._fetch_all(0, attention_mask)
        if layer_idx + 1 < len(self.layers):
            self._fetch_all(layer_idx + 1, attention_mask)

    def _fetch_all(self, nxt: int, attention_mask) -> None:
        target = self.layers[nxt]
        if not target.is_initialized:
            return
        B, G, n = target.k.batch, target.k.heads, target.k.length
        device = target.device
        keep = past_keep(attention_mask, n, device)
        if device not in self._all:  # every layer has the same past and mask within a step: order once
            idx = torch.arange(n, device=device).expand(B, G, n).contiguous()
            real = None if keep is None else keep.expand(B, G, n).contiguous()  # padding fetched, masked
            self._all[device] = (idx, real)
        self._prefetch(target, *self._all[device], keep, 0)
