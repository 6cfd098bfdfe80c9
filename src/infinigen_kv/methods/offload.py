"""`offload`: full offload, FlexGen-style. Every layer's whole K/V lives in the host pool (pinned when a GPU
computes) and is brought to the compute device at every decode step, the next layer's while this one
computes: InfiniGen's cache and transfer machinery with the `FetchAll` selection (every valid row, no
calibration or partial keys). On CPU it degenerates to one copy of the whole cache per step (what
offloading costs where there is no device to offload from)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..config import InfiniGenConfig
from .infinigen.cache import InfiniGenCache
from .infinigen.fetch import Fetch
from .keep import keep_source, layer_keep


class OffloadCache(InfiniGenCache):
    method = "offload"

    def __init__(self, model, kv_dtype: str = "auto", **_):
        super().__init__(model, InfiniGenConfig(kv_dtype=kv_dtype), selection=FetchAll())


class FetchAll:
    """Full offload: every layer's whole K/V lives in the host pool and every valid row is brought to the
    compute device at every decode step, the next layer's while this one computes. Layer 0 has no
    previous layer: it fetches itself in its own pre-hook."""

    calibrated = False
    in_place = False  # the point of the baseline is the copy (on CPU: one copy of the whole cache per step)
    whole = True  # every fetch is a whole past, rows as they lie (no indices to send, nothing to gather)
    static = True  # in a static step (model/static.py) a fetch spans the pool's capacity, the columns past masked

    def dense(self, cache, layer_idx: int) -> bool:
        return False

    @staticmethod
    def max_fetch(cache, layer_idx: int, tokens: int) -> int:
        return tokens

    def choose_at_query(self, cache, layer_idx: int, q: torch.Tensor, step) -> None:
        """Every fetch is started one layer ahead (choose)."""
        return None

    def choose(self, cache, layer_idx: int, x: torch.Tensor, step) -> Iterator[tuple[int, Fetch]]:
        """At layer l's decode input: the whole past of layer l+1 (and of layer 0, at layer 0), as (layer, Fetch)."""
        targets = ([0] if layer_idx == 0 else []) + ([layer_idx + 1] if layer_idx + 1 < len(cache.layers) else [])
        for nxt in targets:
            if cache.layers[nxt].is_initialized:
                yield nxt, self.fetch_all(cache, nxt, step, layer_idx)

    def fetch_all(self, cache, nxt: int, step, layer_idx: int) -> Fetch:
        target = cache.layers[nxt]
        column = step.column  # a static step's: its fetch spans the capacity
        device = target.device
        window = cache.arch.windows[nxt]
        memo, key = step.memo, ("all", device, window, target.k.length, target.k.batch, column is None)
        if key not in memo:  # layers with the same past, mask and window: order once (the step's memo)
            B, G = target.k.batch, target.k.heads
            n = target.k.length if column is None else cache.static_columns()
            keep = layer_keep(cache.arch, nxt, keep_source(cache.arch, step, layer_idx), n, B, device)
            if column is not None:  # the past ends before the step's column
                past = (torch.arange(n, device=device) < column).view(1, 1, n)
                keep = past.expand(B, 1, n) if keep is None else keep & past
            idx = torch.arange(n, device=device).expand(B, G, n)
            real = None if keep is None else keep.expand(B, G, n)  # padding fetched, masked
            memo[key] = (keep, idx if column is not None else idx.contiguous(),
                         real if real is None or column is not None else real.contiguous())
        keep, idx, real = memo[key]
        return Fetch(idx, real, whole=True, keep=keep, fixed=column is not None)

    def reset(self) -> None:
        """Nothing kept across steps."""
