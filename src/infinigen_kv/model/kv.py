"""What a cache layer hands attention for one forward (`KVView`): the value a layer's `view(k, v)` returns and the
attention function reads, passed as an argument; nothing of it is left on the layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class ScoreSink(Protocol):
    """Where attention hands its weights (H2O accumulates them)."""

    def add_prefill_scores(self, query: torch.Tensor, key: torch.Tensor, attention_mask, scaling: float) -> None:
        """A prompt's queries (B, H, T, d) over its keys (B, G, n, d)."""

    def add_scores(self, probs: torch.Tensor) -> None:
        """A decode step's weights (B, G, m) over the view's rows, summed over a group's query heads."""


@dataclass(frozen=True, slots=True)
class KVView:
    """keys, values (B, G, k, d) for this forward's queries, and how to read them:

    - offset: the position of their first row (a sliding window's buffers start there): the model's mask is read
      from that column on;
    - selected: they are a working set chosen for this decode step, attended with `mask`, not the model's mask;
    - mask (B, G or 1, 1, k): which rows of the working set are real (None: all);
    - chosen (slots (B, G, m), count (B, G) or None, the new token's slot: an int, or (B, G)): the working set is
      [new token, the first count slots], read in place from keys / values, which are then whole pool buffers
      (B, G, capacity, d) (the CPU kernel);
    - rows (B, G, m): the pool slots the working set holds (the recall diagnostic);
    - buffers (K, V) (B, G, capacity, d): keys / values are their first k rows, which a decode query may read in
      place (the CPU kernel over a whole cache);
    - scores: where attention hands its weights (H2O), or None."""

    keys: torch.Tensor
    values: torch.Tensor
    offset: int = 0
    selected: bool = False
    mask: torch.Tensor | None = None
    chosen: tuple | None = None
    rows: torch.Tensor | None = None
    buffers: tuple | None = None
    scores: ScoreSink | None = None
