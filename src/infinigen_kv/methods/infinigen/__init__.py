"""InfiniGen (OSDI 2024): the whole KV cache in a host pool; at each decode step and layer, only the rows the
previous layer's speculation chose are fetched.

The modules in the order of the data path:
  calibration.py  the offline skewing (SVD), partial channels, the file format and fingerprint
  offline.py      calibrating a model (its text, its queries and keys), the per-model cache of calibrations
  recall.py       the recall diagnostic (layer_budget "recall")
  cache.py        InfiniGenCache: the container a model decodes with; a step's hand-offs
  contracts.py    the Selection and Transfer Protocols the cache is assembled from
  layer.py        the layers by storage: DeviceLayer (attended whole), PoolLayer (host pool, partial keys, view)
  evicting_pool.py  EvictingPoolLayer: a pool with a capacity (pool.py's eviction), a prompt larger than it
  partial.py      layer l+1's partial query from layer l's input
  speculator.py   scores, alpha threshold, budget caps, per-layer budgets: which rows a step fetches
  fetch.py        a step's fetch and the working set it makes
  transfer.py     moving rows on CPU (attention reads them in place); cuda_transfer.py on a GPU
  pool.py         the pool's capacity and FIFO / LRU / counter eviction
  stats.py        what the steps fetched and read; the recall diagnostic's sums
"""

from __future__ import annotations

from ...config import InfiniGenConfig
from . import offline
from .cache import InfiniGenCache
from .calibration import Calibration, CalibrationError

__all__ = ["InfiniGenCache", "Calibration", "CalibrationError", "calibrate", "make"]


def make(model, tokenizer=None, **options) -> InfiniGenCache:
    """The registry's factory: InfiniGenConfig(**options)."""
    return InfiniGenCache(model, InfiniGenConfig(**options), tokenizer=tokenizer)


def calibrate(model, tokenizer=None, text_file: str | None = None,
              partial_ratio: float = InfiniGenConfig.partial_ratio, channel_rule: str = "qk", skew: str = "auto",
              tokens: int = 4096, seed: int = 0, recall: bool = False) -> Calibration:
    """Calibrate `model` on a text file (needs a tokenizer) or on text the model generates itself; with
    `recall`, also measure each layer's speculation recall on that text (for layer_budget "recall")."""
    return offline.calibrate(model, tokenizer, text_file, partial_ratio, channel_rule, skew, tokens, seed, recall,
                             cache_cls=InfiniGenCache)
