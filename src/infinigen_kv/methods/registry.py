"""Every KV-cache method by name: how to make it (a factory, the options it takes) and what it declares of
itself, the traits the CLI, the server and the benchmarks read instead of testing names. Importing this module
imports no method (nor torch): a factory is imported when a cache is made.

Methods written outside the package join by name, on equal terms with the built-in ones (docs/writing-a-method.md):
`register_method(name, factory, ...)` in the process, or an entry point in the group `infinigen_kv.methods` of an
installed distribution (`keynorm = my_pkg.keynorm:METHOD`, naming a `Method` or a factory), which every command,
the API and the server find by its name without importing it until a cache of it is made.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields, replace
from importlib import import_module
from typing import Any, Callable

from ..config import InfiniGenConfig

ENTRY_POINTS = "infinigen_kv.methods"  # the entry point group of methods installed from outside the package


@dataclass(frozen=True)
class Method:
    """A method: `factory(model, **options)` makes a fresh cache (one of ours: methods/base.Rebatch, or any
    model/kv.StepCache) for a model; `options` the option names it takes (make_cache drops the others; None: every
    keyword its factory names, all of them where it takes **kwargs)."""

    name: str
    factory: str | Callable  # a callable, or "module:callable" (a module under infinigen_kv.methods, or absolute)
    options: frozenset | None = None
    takes_budget: bool = False  # it decodes under a budget (the accuracy bench sweeps it per budget)
    pool_on_host: bool = False  # its K/V live in host memory when a GPU computes (the server's memory budget)
    shares_prefill: bool = False  # its prefill is the full cache's: a bench prefills once and forks the cache
    batches: bool = True  # continuous batching (joins and retires between steps): the server can serve it

    def takes(self, option: str) -> bool:
        """Whether make() hands `option` to the factory (a factory named by its module is imported to read it)."""
        taken = self.options if self.options is not None else _keywords(self._factory())
        return taken is None or option in taken

    def _factory(self) -> Callable:
        factory = self.factory
        if isinstance(factory, str):
            module, attr = factory.split(":")
            factory = getattr(import_module(module if "." in module else f"{__package__}.{module}"), attr)
        return factory

    def make(self, model, **options) -> Any:
        factory = self._factory()
        taken = self.options if self.options is not None else _keywords(factory)
        return factory(model, **{k: v for k, v in options.items() if v is not None and (taken is None or k in taken)})


def _keywords(factory) -> frozenset | None:
    """The keyword options a factory takes (None: any, it has **kwargs)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


_EVICTING = frozenset({"budget", "min_budget", "kv_dtype"})
METHODS = {m.name: m for m in (
    Method("infinigen", "infinigen:make", frozenset(f.name for f in fields(InfiniGenConfig)) | {"tokenizer"},
           takes_budget=True, pool_on_host=True, shares_prefill=True),
    Method("full", "full:FullCache", frozenset({"kv_dtype"}), shares_prefill=True),
    Method("offload", "offload:OffloadCache", frozenset({"kv_dtype"}), pool_on_host=True, shares_prefill=True),
    Method("quant", "quant:QuantCache", frozenset({"bits"})),
    Method("streaming", "streaming:StreamingCache", _EVICTING | {"sink_tokens"}, takes_budget=True, shares_prefill=True),
    Method("h2o", "h2o:H2OCache", _EVICTING | {"recent_ratio"}, takes_budget=True, shares_prefill=True),
    Method("quest", "quest:QuestCache", _EVICTING | {"page_size", "dense_layers"}, takes_budget=True,
           pool_on_host=True, shares_prefill=True),
    Method("snapkv", "snapkv:SnapKVCache", _EVICTING | {"window", "kernel"}, takes_budget=True, shares_prefill=True),
    Method("shadowkv", "shadowkv:ShadowKVCache", _EVICTING | {"chunk", "rank", "local", "outliers", "dense_layers"},
           takes_budget=True, pool_on_host=True, shares_prefill=True),
)}
METHOD_NAMES = tuple(METHODS)  # the built-in ones
REFERENCE = "full"  # the method every other is measured against (exact attention over every entry)
_REGISTERED: dict[str, Method] = {}  # register_method's, and entry points once loaded


def register_method(name: str, factory: str | Callable | Method, *, options=None, takes_budget: bool = False,
                    pool_on_host: bool = False, shares_prefill: bool = False, batches: bool = True) -> Method:
    """Make `name` a method every command, the API and the server accept: factory(model, **options) -> a cache
    (or a Method, whose traits it keeps). The traits say what the harness may do with it (see Method). A built-in
    name cannot be taken."""
    if not isinstance(name, str) or not name or "," in name or name != name.strip():
        raise ValueError(f"a method's name is a word without commas, not {name!r}")
    if name in METHODS:
        raise ValueError(f"{name!r} is a built-in method")
    if isinstance(factory, Method):
        m = replace(factory, name=name)
    else:
        m = Method(name, factory, frozenset(options) if options is not None else None, takes_budget, pool_on_host,
                   shares_prefill, batches)
    _REGISTERED[name] = m
    return m


def _entry_points() -> dict:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINTS)}


def names(serving: bool = False) -> list[str]:
    """Every method's name: the built-in ones, then those registered and installed (entry points, not imported);
    serving: those the server can run (continuous batching; an installed one is checked when it is made)."""
    builtin = [n for n, m in METHODS.items() if not serving or m.batches]
    others = [n for n, m in _REGISTERED.items() if not serving or m.batches]
    return builtin + others + sorted(n for n in _entry_points() if n not in METHODS and n not in _REGISTERED)


def method(name: str) -> Method:
    """The registry's entry of `name` (an installed method's entry point loaded at the first ask; ValueError naming
    the choices for an unknown name)."""
    if name in METHODS:
        return METHODS[name]
    if name in _REGISTERED:
        return _REGISTERED[name]
    ep = _entry_points().get(name)
    if ep is None:
        raise ValueError(f"unknown method {name!r}: choose from {', '.join(names())}")
    try:
        target = ep.load()
    except Exception as e:  # a broken plugin: one line naming it
        raise ValueError(f"method {name!r} ({ep.value}) cannot be loaded: {type(e).__name__}: {e}") from None
    if not isinstance(target, Method) and not callable(target):
        raise ValueError(f"method {name!r}: its entry point {ep.value} names neither a Method nor a factory")
    return register_method(name, target)


def make_cache(name: str, model, **options):
    """A fresh cache of method `name` for `model`; options a method does not take are ignored, None ones too."""
    return method(name).make(model, **options)
