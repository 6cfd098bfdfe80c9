"""Selection strategies: which past rows a decode step fetches for each layer, decided one layer ahead in the
previous layer's attention pre-hook, and started with `cache.prefetch`.

`Speculate` is InfiniGen's: the partial query of layer l+1, computed from layer l's input, scored against
layer l+1's partial key cache; the tokens within alpha of each head's best, at most the budget.
`FetchAll` is full offload (FlexGen-style): every valid row, no calibration, no partial keys.
"""

from __future__ import annotations

import torch

from . import kernels
from .speculate import approx_scores, fetch_cap, row_caps, select
from .transfer import Fetch


def past_keep(attention_mask, n: int, device=None):
    """(B, 1, n) bool of the past positions a decode token may attend (False: padding, user-masked), from
    the step's mask (B, 1, 1, n + 1) (bool, or additive float with 0 = attend), on `device`; None when
    there is none."""
    if attention_mask is None:
        return None
    m = attention_mask[:, :, -1, :n].to(device or attention_mask.device, non_blocking=True)
    return m if m.dtype == torch.bool else m == 0


class Speculate:
    """InfiniGen's speculation. Layer 0 attends over its whole cache, which stays on the device."""

    calibrated = True  # needs the offline calibration and a partial key cache per layer
    in_place = True  # on CPU, attention may read the chosen rows where they lie in the pool

    def __init__(self):
        self._memo = None  # (key, keep, caps) of the current decode step (step_keep)

    def dense(self, layer_idx: int) -> bool:
        return layer_idx == 0

    def before_attention(self, cache, layer_idx: int, x: torch.Tensor, rope, attention_mask) -> None:
        """Called with layer l's attention input x (B, 1, D): speculate and prefetch layer l+1.

        Layer 0's input is the raw embedding, too unlike layer 1's to predict it (measured attention
        recall 0.1-0.4 where later layers get 0.9+): layer 0 speculates nothing and layer 1 speculates
        itself from its own input, just before it runs. Every later layer is chosen one layer ahead.
        """
        if x.shape[1] != 1:  # prefill: everything is attended
            if cache.limited and layer_idx > 0:  # keep what the pool may need to choose from, if it overflows
                last = tuple(t[:, -1:] for t in rope) if rope is not None else None
                cache.layers[layer_idx].prefill_query = (x[:, -1:], last, past_keep(attention_mask, x.shape[1]))
            return
        if layer_idx == 0:
            return  # layer 0: see above
        if layer_idx == 1:
            self.speculate(cache, 1, x, rope, attention_mask)
        if layer_idx + 1 < len(cache.layers):
            self.speculate(cache, layer_idx + 1, x, rope, attention_mask)

    def speculate(self, cache, nxt: int, x: torch.Tensor, rope, attention_mask) -> None:
        target = cache.layers[nxt]
        if not target.is_initialized:
            return
        dev = target.device
        if x.device != dev:  # device_map: layer l's input, RoPE and mask go to layer l+1's device
            x = x.to(dev, non_blocking=True)
            rope = tuple(t.to(dev, non_blocking=True) for t in rope) if rope is not None else None
        q = cache.partial_query(nxt, x, rope)  # (B, G, r, p)
        n = target.partial.length  # slots
        B, G = q.shape[:2]
        evicted = target.slots is not None and target.slots.evicted
        keep, caps = self.step_keep(cache, attention_mask, target.seen, dev, B, G, not evicted)
        if keep is not None and evicted:
            keep = keep.expand(B, G, -1).gather(-1, target.slots.pos.valid()[..., 0])  # (B, G, slots)
        c = cache.config
        partial_row = target.partial.width * target.partial.data.element_size()
        kern = kernels.cpu() if dev.type == "cpu" else None
        if kern is not None:  # one pass: scores, relative, combine, count, cap, chosen slots; no host sync
            k = fetch_cap(n, c.budget, c.max_num_kv)  # known on the host: the step's fetch size
            if keep is not None and caps is None:  # per row: budget x its valid length
                keep = keep.contiguous()
                caps = row_caps(keep, c.budget, c.max_num_kv).expand(B, G).contiguous()  # (B, G)
            idx, count = kern.speculate(q.float().contiguous(), target.partial.data, n, keep, caps,
                                        cache.arch.score_scale, c.alpha, k, c.gqa_combine == "mean")
            cache.prefetch(target, Fetch(idx, count=count), keep, partial_row)
            return
        scores = approx_scores(q, target.partial.valid(), cache.arch.score_scale)  # (B, G, r, slots)
        idx, real = select(scores, keep, c.alpha, c.budget, c.max_num_kv, c.gqa_combine)
        cache.prefetch(target, Fetch(idx, real), keep, partial_row)

    def step_keep(self, cache, attention_mask, seen: int, dev, B: int, G: int, with_caps: bool):
        """keep (B, 1, seen) of the step's mask (see past_keep) and, if with_caps, the per-row caps (B, G)
        of the CPU kernel: the same for every layer of a decode step, so computed once per step."""
        key = (None if attention_mask is None else attention_mask.data_ptr(), seen, dev, B, G)
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1], self._memo[2] if with_caps else None
        keep = past_keep(attention_mask, seen, dev)
        caps = None
        if keep is not None:
            keep = keep.contiguous()
            c = cache.config
            caps = row_caps(keep, c.budget, c.max_num_kv).expand(B, G).contiguous()
        self._memo = (key, keep, caps)
        return keep, caps if with_caps else None

    def reset(self) -> None:
        self._memo = None


class FetchAll:
    """Full offload: every layer's whole K/V lives in the host pool and every valid row is brought to the
    compute device at every decode step, the next layer's while this one computes. Layer 0 has no
    previous layer: it fetches itself in its own pre-hook."""

    calibrated = False
    in_place = False  # the point of the baseline is the copy (on CPU: one copy of the whole cache per step)

    def __init__(self):
        self._all = {}  # device -> (idx, real) of the current step, shared by every layer on that device

    def dense(self, layer_idx: int) -> bool:
        return False

    def before_attention(self, cache, layer_idx: int, x: torch.Tensor, rope, attention_mask) -> None:
        if x.shape[1] != 1:
            return  # prefill attends over the prompt itself
        if layer_idx == 0:
            self._all = {}
            self.fetch_all(cache, 0, attention_mask)
        if layer_idx + 1 < len(cache.layers):
            self.fetch_all(cache, layer_idx + 1, attention_mask)

    def fetch_all(self, cache, nxt: int, attention_mask) -> None:
        target = cache.layers[nxt]
        if not target.is_initialized:
            return
        B, G, n = target.k.batch, target.k.heads, target.k.length
        device = target.device
        keep = past_keep(attention_mask, n, device)
        if device not in self._all:  # every layer has the same past and mask within a step: order once
            idx = torch.arange(n, device=device).expand(B, G, n).contiguous()
            real = None if keep is None else keep.expand(B, G, n).contiguous()  # padding fetched, masked
            self._all[device] = (idx, real)
        cache.prefetch(target, Fetch(*self._all[device]), keep, 0)

    def reset(self) -> None:
        self._all = {}
