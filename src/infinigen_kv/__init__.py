"""infinigen-kv: InfiniGen's speculative KV-cache selection over a host KV pool, and the methods it is compared with.

The layout, in the order of the data path (load -> calibrate -> prefill -> speculate -> prefetch -> attend):
  config.py   options and defaults        model/     load, per-architecture facts, what is installed, kernels
  methods/    every KV-cache method (InfiniGen in methods/infinigen/), a registry by name
  runtime/    generation (prefill, decode loop), continuous batching, the prefix store, sampling, threads
  serve/      the OpenAI-compatible server    bench/  the benchmarks    cli.py  the command line

The names below are imported on first use (PEP 562), so `infinigen --help` and `--version` answer without
importing torch or transformers. Modules that moved in the re-layout stay importable by their old names.
"""

import sys
import warnings
from importlib import import_module
from importlib.abc import Loader, MetaPathFinder
from importlib.util import spec_from_loader

__version__ = "0.1.0"

_WHERE = {
    "METHODS": ".methods.registry", "make_cache": ".methods.registry", "register_method": ".methods.registry",
    "Method": ".methods.registry", "method_names": ".methods.registry", "InfiniGenCache": ".methods.infinigen",
    "Calibration": ".methods.infinigen", "CalibrationError": ".methods.infinigen", "calibrate": ".methods.infinigen",
    "ConfigError": ".config", "InfiniGenConfig": ".config", "generate": ".runtime.generation",
    "load_model": ".model.load", "PrefixStore": ".runtime.prefix", "from_hf": ".model.weights",
    "Transformer": ".model.transformer",
}
__all__ = list(_WHERE)


_NAMED = {"method_names": "names"}  # exported under another name than the module's


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_WHERE[name], __name__), _NAMED.get(name, name))
    globals()[name] = value  # once
    return value


def __dir__():
    return sorted(list(globals()) + __all__)


# old module -> its new place (the package's earlier layout)
MOVED = {
    "adapters": "model.arch", "attention": "model.attention", "kernels": "model.kernels", "models": "model.load",
    "baselines": "methods.registry", "baselines.full": "methods.full", "baselines.offload": "methods.offload",
    "baselines.h2o": "methods.h2o", "baselines.streaming": "methods.streaming", "baselines.quant": "methods.quant",
    "baselines.evicting": "methods.evicting", "layer": "methods.base", "pool": "methods.rows",
    "selection": "methods.infinigen.speculator", "speculate": "methods.infinigen.speculator",
    "cache": "methods.infinigen.cache", "transfer": "methods.infinigen.transfer",
    "generation": "runtime.generation", "batching": "runtime.batching", "sampling": "runtime.sampling",
    "threads": "runtime.threads", "tee": "bench.tee", "report": "bench.report",
}
# "calibrate" was a module and is the package's function: the old module is not aliased (it would shadow it)
GONE = {"calibrate": "infinigen_kv.methods.infinigen.calibration (the file format), .offline (calibrating), "
                     "infinigen_kv.calibrate (the function)"}


class _Moved(MetaPathFinder, Loader):
    """`import infinigen_kv.cache` (an old path) gives infinigen_kv.methods.infinigen.cache, with a warning."""

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, rest = fullname.partition(".")
        if prefix != __name__ or not rest:
            return None
        if rest in GONE:
            raise ModuleNotFoundError(f"{fullname} moved: see {GONE[rest]}", name=fullname)
        return spec_from_loader(fullname, self) if rest in MOVED else None

    def create_module(self, spec):
        new = f"{__name__}.{MOVED[spec.name.partition('.')[2]]}"
        warnings.warn(f"{spec.name} moved to {new}", DeprecationWarning, stacklevel=2)
        return import_module(new)

    def exec_module(self, module) -> None:
        """The new module is already executed."""


sys.meta_path.append(_Moved())
