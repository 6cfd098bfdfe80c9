"""transformers' own caches in the same harness: `hf-dynamic` (DynamicCache) and `hf-offloaded` (its offloaded
cache: every layer's K/V on the host, the whole layer brought back, and the next one prefetched, at each forward)."""

from __future__ import annotations

from transformers import DynamicCache


def dynamic(model, **_):
    return DynamicCache(config=model.config)


def offloaded(model, **_):
    """It offloads from a GPU: refused for a model on the CPU."""
    if next(model.parameters()).device.type != "cuda":
        raise ValueError("hf-offloaded (transformers' offloaded cache) offloads a GPU's cache: the model must be on cuda")
    return DynamicCache(config=model.config, offloading=True)
