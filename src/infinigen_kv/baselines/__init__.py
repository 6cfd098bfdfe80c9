"""Every KV-cache method as a transformers Cache, made by one factory by name."""

from __future__ import annotations

from dataclasses import fields

from transformers import DynamicCache

from ..config import InfiniGenConfig

from .full import FullCache
from .h2o import H2OCache
from .offload import OffloadCache
from .quant import QuantCache
from .streaming import StreamingCache


def _infinigen(model, **options):
    from ..cache import InfiniGenCache

    tokenizer = options.pop("tokenizer", None)
    return InfiniGenCache(model, InfiniGenConfig(**options), tokenizer=tokenizer)


def _hf_dynamic(model, **_):
    return DynamicCache(config=model.config)


def _hf_offloaded(model, **_):
    """transformers' own offloaded cache: every layer's K/V on the host, the whole layer brought back (and the
    next one prefetched) at each forward. It offloads from a GPU: refused for a model on the CPU."""
    if next(model.parameters()).device.type != "cuda":
        raise ValueError("hf-offloaded (transformers' offloaded cache) offloads a GPU's cache: the model must be on cuda")
    return DynamicCache(config=model.config, offloading=True)


# name -> (factory, options it takes)
METHODS = {
    "infinigen": (_infinigen, {f.name for f in fields(InfiniGenConfig)} | {"tokenizer"}),
    "full": (FullCache, set()),
    "offload": (OffloadCache, set()),
    "quant": (QuantCache, {"bits"}),
    "streaming": (StreamingCache, {"budget", "min_budget", "sink_tokens"}),
    "h2o": (H2OCache, {"budget", "min_budget", "recent_ratio"}),
    "hf-dynamic": (_hf_dynamic, set()),
    "hf-offloaded": (_hf_offloaded, set()),
}


def make_cache(name: str, model, **options):
    """A fresh cache of method `name` for `model`; options a method does not take are ignored, None ones too."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}: choose from {', '.join(METHODS)}")
    factory, accepted = METHODS[name]
    return factory(model, **{k: v for k, v in options.items() if k in accepted and v is not None})
