"""`quest`: Quest (Tang et al., ICML 2024), query-aware page selection. The K/V of every layer live in the pool in
pages of `page_size` tokens; each page keeps the per-channel minimum and maximum of its keys. At a decode step a
layer's own query bounds each page's largest attention logit from above, sum over channels of max(q m, q M), and
the step attends over the pages of the highest bounds, up to the budget, and the new token. The first
`dense_layers` layers (two in the paper) attend everything.

Built on InfiniGen's pool and transfers (methods/infinigen/): `QuestSelect` is the selection, chosen at each layer's
own query (`choose_at_query`), with no calibration and no partial keys. A KV head serves all r query heads of its
group: each head's bounds are taken relative to its own largest and the group's heads combined by their maximum (a
page any head ranks high is kept), as InfiniGen combines its heads. A page's bounds are made once it is full and
kept; the last, partial page's each step from its few rows. Exact at budget 1.0: a cap that leaves nothing out
attends the whole past, as full does.

Shapes: B sequences, G KV heads, r query heads each, d head size, n past tokens, P pages, k chosen pages.
"""

from __future__ import annotations

import torch

from ..config import DEFAULT_BUDGET, DEFAULT_MIN_BUDGET, InfiniGenConfig
from ..model.kv import from_rows
from .infinigen.cache import InfiniGenCache
from .at_query import AtQuery
from .infinigen.fetch import Fetch


def page_bounds(keys: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys (B, G, t, d) float32, t a multiple of `page` -> per page (min, max) (B, G, t / page, d)."""
    B, G, t, d = keys.shape
    pages = keys.view(B, G, t // page, page, d)
    return pages.amin(3), pages.amax(3)


def upper_bounds(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """q (B, G, r, d) over pages bounded by lo, hi (B, G, P, d) -> (B, G, r, P): the largest q . k a key of the page
    can reach, sum over channels of max(q lo, q hi) = q+ . hi + q- . lo (two products)."""
    return q.clamp(min=0) @ hi.transpose(-1, -2) + q.clamp(max=0) @ lo.transpose(-1, -2)


class QuestSelect(AtQuery):
    in_place = True  # on CPU attention reads the chosen pages' rows where they lie in the pool

    def __init__(self, page_size: int = 16, dense_layers: int = 2):
        if page_size < 1 or dense_layers < 0:
            raise ValueError(f"quest: page_size >= 1 and dense_layers >= 0, got {page_size}, {dense_layers}")
        self.page, self.dense_layers = page_size, dense_layers
        self.bounds: dict = {}  # layer -> (lo, hi) (B, G, P_full, d) of its full pages, on its compute device

    def reset(self) -> None:
        self.bounds = {}  # (rows moved between sequences: made again from the pool)

    def choose_at_query(self, cache, layer_idx: int, q: torch.Tensor, step) -> Fetch | None:
        """Layer l's pages for its decode query q (B, H, 1, d), RoPE applied; None where its cap leaves none of
        its past out (it attends all of it)."""
        past = self.past(cache, layer_idx)
        if past is None:
            return None
        target, n, cap = past
        B, G, page = target.k.batch, target.k.heads, self.page
        lo, hi = self._bounds(target, layer_idx, n)  # (B, G, P, d)
        P = lo.shape[2]
        s = upper_bounds(q.reshape(B, G, -1, q.shape[-1]).float(), lo, hi)  # (B, G, r, P)
        keep = self.past_keep(step, layer_idx, n)  # (B, n) or None: padding
        if keep is not None:
            pages_kept = torch.nn.functional.pad(keep, (0, P * page - n)).view(B, 1, 1, P, page).any(-1)
            s = s.masked_fill(~pages_kept, float("-inf"))
        rel = (s - s.amax(-1, keepdim=True)).amax(2)  # (B, G, P): each head relative to its best, heads combined
        k = min(P, max(1, cap // page))
        chosen = rel.topk(k, dim=-1, sorted=True).indices  # (B, G, k)
        idx = (chosen.unsqueeze(-1) * page + torch.arange(page, device=chosen.device)).view(B, G, k * page)
        real = idx < n
        if keep is not None:
            real &= keep.unsqueeze(1).expand(B, G, n).gather(-1, idx.clamp(max=n - 1))
        order = (~real).to(torch.int8).argsort(dim=-1, stable=True)  # real slots first, in page order
        idx, real = idx.gather(-1, order).clamp_(max=n - 1)[..., :cap], real.gather(-1, order)[..., :cap]
        count = real.sum(-1).clamp_(min=1)  # (B, G)
        scored = 2 * lo.shape[-1] * 4 // page  # bytes of bounds a past token accounts for (float32 min and max)
        return Fetch(idx.contiguous(), count=count, keep=None if keep is None else keep.unsqueeze(1), scored=scored)

    def _bounds(self, target, layer_idx: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(lo, hi) (B, G, ceil(n / page), d) of the layer's n stored keys: the full pages' kept (made as they fill),
        the last partial page's from its rows."""
        page, dev = self.page, target.device
        full = n // page
        lo, hi = self.bounds.get(layer_idx, (None, None))
        done = 0 if lo is None else lo.shape[2]
        if done > full or (lo is not None and lo.shape[:2] != (target.k.batch, target.k.heads)):
            lo = hi = None
            done = 0
        if done < full:  # pages filled since the last step
            keys = from_rows(target.k.data[:, :, done * page : full * page], torch.float32).to(dev)
            new_lo, new_hi = page_bounds(keys, page)
            lo = new_lo if lo is None else torch.cat([lo, new_lo], 2)
            hi = new_hi if hi is None else torch.cat([hi, new_hi], 2)
            self.bounds[layer_idx] = (lo, hi)
        if full * page < n:  # the partial last page
            tail = from_rows(target.k.data[:, :, full * page : n], torch.float32).to(dev)  # (B, G, < page, d)
            t_lo, t_hi = tail.amin(2, keepdim=True), tail.amax(2, keepdim=True)
            lo = t_lo if lo is None else torch.cat([lo, t_lo], 2)
            hi = t_hi if hi is None else torch.cat([hi, t_hi], 2)
        return lo, hi


class QuestCache(InfiniGenCache):
    """`QuestCache(model, budget=0.1, page_size=16, dense_layers=2)`: at most max(budget x past, min_budget) rows a
    (sequence, KV head, layer), in whole pages of the highest bounds."""

    method = "quest"

    def __init__(self, model, budget: float = DEFAULT_BUDGET, min_budget: int = DEFAULT_MIN_BUDGET,
                 page_size: int = 16, dense_layers: int = 2, kv_dtype: str = "auto", **_):
        config = InfiniGenConfig(budget=budget, min_budget=min_budget, kv_dtype=kv_dtype, min_saving=0.0)
        super().__init__(model, config, selection=QuestSelect(page_size, dense_layers))
