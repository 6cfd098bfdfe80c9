"""Every KV-cache method by name: how to make it (a factory, the options it takes) and what it declares of
itself, the traits the CLI, the server and the benchmarks read instead of testing names. Importing this module
imports no method (nor torch): a factory is imported when a cache is made.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from importlib import import_module

from ..config import InfiniGenConfig


@dataclass(frozen=True)
class Method:
    name: str
    factory: str  # "module:callable" under infinigen_kv.methods: (model, **options) -> a transformers Cache
    options: frozenset  # the options it takes (make_cache drops the others)
    takes_budget: bool = False  # it decodes under a budget (the accuracy bench sweeps it per budget)
    pool_on_host: bool = False  # its K/V live in host memory when a GPU computes (the server's memory budget)
    shares_prefill: bool = False  # its prefill is the full cache's: a bench prefills once and forks the cache
    batches: bool = True  # continuous batching (joins and retires between steps): the server can serve it


_EVICTING = frozenset({"budget", "min_budget", "kv_dtype"})
METHODS = {m.name: m for m in (
    Method("infinigen", "infinigen:make", frozenset(f.name for f in fields(InfiniGenConfig)) | {"tokenizer"},
           takes_budget=True, pool_on_host=True, shares_prefill=True),
    Method("full", "full:FullCache", frozenset({"kv_dtype"}), shares_prefill=True),
    Method("offload", "offload:OffloadCache", frozenset({"kv_dtype"}), pool_on_host=True, shares_prefill=True),
    Method("quant", "quant:QuantCache", frozenset({"bits"})),
    Method("streaming", "streaming:StreamingCache", _EVICTING | {"sink_tokens"}, takes_budget=True, shares_prefill=True),
    Method("h2o", "h2o:H2OCache", _EVICTING | {"recent_ratio"}, takes_budget=True, shares_prefill=True),
)}
METHOD_NAMES = tuple(METHODS)
REFERENCE = "full"  # the method every other is measured against (exact attention over every entry)


def method(name: str) -> Method:
    """The registry's entry of `name` (ValueError naming the choices for another)."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}: choose from {', '.join(METHODS)}")
    return METHODS[name]


def make_cache(name: str, model, **options):
    """A fresh cache of method `name` for `model`; options a method does not take are ignored, None ones too."""
    m = method(name)
    module, attr = m.factory.split(":")
    factory = getattr(import_module(f"{__package__}.{module}"), attr)
    return factory(model, **{k: v for k, v in options.items() if k in m.options and v is not None})
