"""Selection strategies: which past rows a decode step fetches for each layer, decided one layer ahead in the
previous layer's attention pre-hook, and started with `cache.prefetch`.

`Speculate` is InfiniGen's: the partial query of layer l+1, computed from layer l's input, scored against
layer l+1's partial key cache; the tokens within alpha of each head's best, at most the budget.
`FetchAll` is full offload (FlexGen-style): every valid row, no calibration, no partial keys.
"""

from __future__ import annotations

import torch

from . import kernels
from .speculate import approx_scores, fetch_cap, row_caps, saves_bytes, select
from .transfer import Fetch


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


def keep_source(arch, attention_mask):
    """The mask a decode step reads its keep from: the calling layer's own (None when transformers dropped
    it: nothing is masked), which is also the next layer's where every layer has the same window; where
    local and global layers differ, the mask the model was called with (the window is applied per layer)."""
    if attention_mask is None or not arch.mixed:
        return attention_mask
    return arch.step.mask


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


class Speculate:
    """InfiniGen's speculation. Layer 0 attends over its whole cache, which stays on the device."""

    calibrated = True  # needs the offline calibration and a partial key cache per layer
    in_place = True  # on CPU, attention may read the chosen rows where they lie in the pool
    whole = False  # fetches chosen rows (by index), not whole pasts

    def __init__(self):
        self._memo = {}  # window -> (key, keep, {budget: caps}) of the current decode step (step_keep)
        self._dense_step = False  # this decode step's past is under every layer's cap (_under_floor)

    def dense(self, cache, layer_idx: int) -> bool:
        """Layer 0, and a model's local layers unless `local_layers="speculate"`: their window is short (512
        tokens on Gemma 3) and attending all of it measured better (docs/BENCHMARKS.md, "Gemma 3")."""
        return layer_idx == 0 or (cache.arch.local(layer_idx) and cache.config.local_layers == "dense")

    def before_attention(self, cache, layer_idx: int, x: torch.Tensor, rope, attention_mask) -> None:
        """Called with layer l's attention input x (B, 1, D): speculate and prefetch layer l+1.

        Layer 0's input is the raw embedding, too unlike layer 1's to predict it (measured attention
        recall 0.1-0.4 where later layers get 0.9+): layer 0 speculates nothing and layer 1 speculates
        itself from its own input, just before it runs. Every later layer is chosen one layer ahead.
        """
        if x.shape[1] != 1:  # prefill: everything is attended
            if cache.limited and layer_idx > 0:  # keep what the pool may need to choose from, if it overflows
                last = tuple(t[:, -1:] for t in rope) if rope is not None else None
                keep = valid_keys(attention_mask, x.shape[1])  # the layer's own mask: its last query's keys
                cache.layers[layer_idx].prefill_query = (x[:, -1:], last, None if keep is None else keep.unsqueeze(1))
            return
        if layer_idx == 0:  # layer 0: see above
            self._dense_step = self._under_floor(cache)
            return
        if self._dense_step:
            return
        if layer_idx == 1:
            self.speculate(cache, 1, x, rope, attention_mask)
        if layer_idx + 1 < len(cache.layers):
            self.speculate(cache, layer_idx + 1, x, rope, attention_mask)

    @staticmethod
    def _under_floor(cache) -> bool:
        """Whether no layer's cap leaves out any of its past this step (a short past under min_budget): then no
        layer speculates or attends through a selection (CPU, a pool without capacity; once a step, at layer 0)."""
        c = cache.config
        for layer in cache.layers[1:]:
            if not layer.is_initialized or layer.dense:
                continue
            if layer.slots is not None or not layer.transfer.host_compute:
                return False
            n = layer.partial.length
            if fetch_cap(n, cache.budget_of(layer.layer_idx), c.max_num_kv, c.min_budget) < n:
                return False
        return True

    def speculate(self, cache, nxt: int, x: torch.Tensor, rope, attention_mask) -> None:
        target = cache.layers[nxt]
        if not target.is_initialized or target.dense:
            return
        dev = target.device
        rope = cache.arch.rope_for(nxt, rope)  # layer l+1's own (Gemma 3: per layer type)
        if x.device != dev:  # device_map: layer l's input, RoPE and mask go to layer l+1's device
            x = x.to(dev, non_blocking=True)
            rope = tuple(t.to(dev, non_blocking=True) for t in rope) if rope is not None else None
        n = target.partial.length  # slots
        c = cache.config
        budget = cache.budget_of(nxt)
        k = fetch_cap(n, budget, c.max_num_kv, c.min_budget)  # known on the host: the step's fetch size
        partial_row = target.partial.width * target.partial.data.element_size()
        row = (target.k.width + target.v.width) * target.k.data.element_size()
        if target.slots is None and target.transfer.host_compute and not saves_bytes(n, k, row, partial_row):
            # the cap leaves nothing to save (a short past under the floor): the layer attends densely, in place
            # (on CUDA a dense pool layer would be copied to the device synchronously: it fetches all it may)
            return
        q = cache.partial_query(nxt, x, rope)  # (B, G, r, p)
        B, G = q.shape[:2]
        evicted = target.slots is not None and target.slots.evicted
        keep, caps = self.step_keep(cache, nxt, attention_mask, target.seen, dev, B, G, not evicted, budget)
        if keep is not None and evicted:
            keep = keep.expand(B, G, -1).gather(-1, target.slots.pos.valid()[..., 0])  # (B, G, slots)
        kern = kernels.cpu() if dev.type == "cpu" else None
        if kern is not None:  # one pass: scores, relative, combine, count, cap, chosen slots; no host sync
            if keep is not None and caps is None:  # per row: budget x its valid length
                keep = keep.contiguous()
                caps = row_caps(keep, budget, c.max_num_kv, c.min_budget).expand(B, G).contiguous()  # (B, G)
            idx, count = kern.speculate(q.float().contiguous(), target.partial.data, n, keep, caps,
                                        cache.arch.score_scale, c.alpha, k, c.gqa_combine == "mean")
            cache.prefetch(target, Fetch(idx, count=count), keep, partial_row)
            return
        scores = approx_scores(q, target.partial.valid(), cache.arch.score_scale)  # (B, G, r, slots)
        idx, count = select(scores, keep, c.alpha, budget, c.max_num_kv, c.gqa_combine, c.min_budget)
        cache.prefetch(target, Fetch(idx, count=count), keep, partial_row)

    @staticmethod
    def max_fetch(cache, layer_idx: int, tokens: int) -> int:
        """The most rows one decode step of `layer_idx` fetches per (sequence, KV head) up to `tokens` tokens."""
        c = cache.config
        return fetch_cap(tokens, cache.budget_of(layer_idx), c.max_num_kv, c.min_budget)

    def step_keep(self, cache, layer: int, attention_mask, seen: int, dev, B: int, G: int, with_caps: bool,
                  budget: float):
        """keep (B, 1, seen) of `layer` (layer_keep) and, if with_caps, the per-row caps (B, G) of the CPU
        kernel at `budget`: the same for every layer of a decode step with the same window (and budget), so
        computed once per step."""
        mask = keep_source(cache.arch, attention_mask)
        window = cache.arch.windows[layer]
        key = (None if mask is None else mask.data_ptr() if torch.is_tensor(mask) else id(mask), seen, dev, B, G)
        memo = self._memo.get(window)
        if memo is None or memo[0] != key:
            keep = layer_keep(cache.arch, layer, mask, seen, B, dev)
            memo = self._memo[window] = (key, None if keep is None else keep.contiguous(), {})
        keep, caps = memo[1], memo[2]
        if keep is None or not with_caps:
            return keep, None
        if budget not in caps:
            c = cache.config
            caps[budget] = row_caps(keep, budget, c.max_num_kv, c.min_budget).expand(B, G).contiguous()
        return keep, caps[budget]

    def reset(self) -> None:
        self._memo = {}


class FetchAll:
    """Full offload: every layer's whole K/V lives in the host pool and every valid row is brought to the
    compute device at every decode step, the next layer's while this one computes. Layer 0 has no
    previous layer: it fetches itself in its own pre-hook."""

    calibrated = False
    in_place = False  # the point of the baseline is the copy (on CPU: one copy of the whole cache per step)
    whole = True  # every fetch is a whole past, rows as they lie (no indices to send, nothing to gather)

    def __init__(self):
        self._all = {}  # device -> (idx, real) of the current step, shared by every layer on that device

    def dense(self, cache, layer_idx: int) -> bool:
        return False

    @staticmethod
    def max_fetch(cache, layer_idx: int, tokens: int) -> int:
        return tokens

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
        window = cache.arch.windows[nxt]
        if (device, window) not in self._all:  # layers with the same past, mask and window: order once
            keep = layer_keep(cache.arch, nxt, keep_source(cache.arch, attention_mask), n, B, device)
            idx = torch.arange(n, device=device).expand(B, G, n).contiguous()
            real = None if keep is None else keep.expand(B, G, n).contiguous()  # padding fetched, masked
            self._all[(device, window)] = (keep, idx, real)
        keep, idx, real = self._all[(device, window)]
        cache.prefetch(target, Fetch(idx, real, whole=True), keep, 0)

    def reset(self) -> None:
        self._all = {}
