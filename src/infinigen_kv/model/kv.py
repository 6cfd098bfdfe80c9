"""What the decode step asks of a cache (`StepCache`, the base of every cache made here) and what a cache layer hands
attention for one forward (`KVView`): the value a layer's `view(k, v)` returns and the attention function reads,
passed as an argument; nothing of it is left on the layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from . import int8_rows


def kv_storage(option: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype K/V rows are stored in (config.KV_DTYPES) for a model computing in `dtype` on `device`: "auto" is
    bfloat16 for a float32 model on CPU (half the bytes a token; attention still computed in float32) and the
    model's dtype otherwise (a GPU model computes in bf16/fp16 already)."""
    if option == "auto":
        return torch.bfloat16 if dtype == torch.float32 and torch.device(device).type == "cpu" else dtype
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}[option]


def row_width(d: int, storage: torch.dtype) -> int:
    """Elements a stored row of d values takes: int8 rows end with their groups' scales (model/int8_rows.py)."""
    return int8_rows.kv_width(d) if storage == torch.int8 else d


def to_rows(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """x (..., d) as rows of `storage` (..., row_width): int8 rows quantized with their scales (rows already int8 are
    taken as stored); other storage is a cast."""
    if storage == torch.int8:
        return x if x.dtype == torch.int8 else int8_rows.pack_kv(x)
    return x.to(storage)


def from_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows (..., row_width) -> the values they hold (..., d) in `dtype` (for PyTorch's attention: the CPU
    kernels read the rows as they are)."""
    return int8_rows.unpacked_kv(rows, dtype) if rows.dtype == torch.int8 else rows.to(dtype)


class StepCache:
    """A cache made here (methods/base.py's Rebatch and its methods): its layers' `view(k, v, fetch)` return KVViews,
    and attention blocks call `before_attention` first. Code that takes any transformers cache tells ours by this
    class, never by probing for an attribute. The defaults are a method that selects nothing."""

    track_recall = False  # attention reports each step's true attention on its working set (a diagnostic)
    static = False  # its layers' views take `at`, the device column of a static step (model/static.py)

    def __init__(self, layers=()):
        self.layers = list(layers)  # one per decoder layer: its `view(k, v, fetch)` stores k, v and returns a KVView

    def __len__(self) -> int:
        return len(self.layers)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layers=[{', '.join(type(l).__name__ for l in self.layers)}])"

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens each sequence holds (its past: the positions the next token follows)."""
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_):
        """Layer layer_idx's keys and values after storing k, v (B, G, T, d) (a plain cache's API)."""
        return self.layers[layer_idx].update(key_states, value_states)

    def before_attention(self, layer_idx: int, x: torch.Tensor, step) -> list:
        """Called by layer l with its attention input x (B, T, D) and the forward's step.Step (positions,
        each layer's RoPE and mask, a static step's column, the step's memo): a method that chooses what a step
        reads does it here, and returns what it started for later layers, (layer, fetch) each; the layer loop
        hands each to that layer's view."""
        return []

    def after_query(self, layer_idx: int, q: torch.Tensor, step):
        """Called by layer l of a decode step with its query q (B, H, 1, d), RoPE applied, when no earlier layer
        started a fetch for it: a method that chooses a layer's reads from its own query does it here and returns
        that fetch for the layer's view; None otherwise."""
        return None

    def reserve(self, tokens: int) -> None:
        """Size buffers for `tokens` tokens per sequence when they are made (none grows inside decode)."""

    def bookkeeping(self):
        """The host counts a decode step adds (a static step replayed as a CUDA graph runs no Python: the graph's
        owner takes them around its warm-up and adds them after every replay, model/static.py)."""
        return None

    def restore_bookkeeping(self, state) -> None:
        """Back to `state` (bookkeeping()), device accumulators in place."""

    def replayed(self, before, after) -> None:
        """A replayed step: add the host counts one step added between two bookkeeping() states."""

    def prefix_facts(self, model) -> dict | None:
        """What changes the rows this cache stores for `model` beyond the model and the method (runtime/prefix.py); None: it
        does not continue from stored blocks."""
        return None


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
