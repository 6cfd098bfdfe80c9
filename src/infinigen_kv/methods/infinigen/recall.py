"""The recall diagnostic of a calibration: per layer, the share of its true attention mass on the entries
InfiniGen fetches (what layer_budget "recall" shares the budget by). It runs InfiniGen's decode, so the cache
class is passed in: the cache calibrates (offline.py), and this module never imports it.
"""

from __future__ import annotations

import torch

from ...config import InfiniGenConfig
from ...runtime.generation import generate
from .calibration import Calibration


RECALL_BUDGET, RECALL_STEPS = 0.1, 16  # the setting each layer's recall is measured at



@torch.inference_mode()
def measure_recall(model, cal: Calibration, ids: torch.Tensor, cache_cls, steps: int = RECALL_STEPS) -> list:
    """Per layer: the share of its true attention mass on the entries InfiniGen fetches at budget 0.1 (other
    knobs at their defaults), over `steps` greedy decode steps after the calibration text joined into one row
    (its rows are short; joined, the budget binds as at long context). None for a layer attended densely
    (layer 0, local layers). Where it is low, the partial channels predict that layer's attention worst.
    cache_cls: InfiniGenCache (passed in: the cache calibrates through this module's callers)."""
    config = InfiniGenConfig(partial_ratio=cal.meta["partial_ratio"], budget=RECALL_BUDGET, min_budget=0)
    cache = cache_cls(model, config, calibration=cal)
    cache.track_recall = True
    row = ids.reshape(1, -1).to(next(model.parameters()).device)
    generate(model, row, cache=cache, max_new_tokens=steps, stop_at_eos=False)
    got = cache.stats["recall_per_layer"]
    return [None if layer.dense else round(float(got[i] or 0.0), 4) for i, layer in enumerate(cache.layers)]
