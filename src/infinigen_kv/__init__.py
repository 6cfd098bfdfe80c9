"""infinigen-kv: InfiniGen's speculative KV-cache selection over a host KV pool, for transformers models.

The names below are imported on first use (PEP 562), so `infinigen --help` and `--version` answer without
importing torch or transformers.
"""

import sys
import types
from importlib import import_module

__version__ = "0.1.0"

_WHERE = {
    "METHODS": ".baselines", "make_cache": ".baselines", "InfiniGenCache": ".cache", "Calibration": ".calibrate",
    "CalibrationError": ".calibrate", "calibrate": ".calibrate", "ConfigError": ".config",
    "InfiniGenConfig": ".config", "generate": ".generation", "load_model": ".models",
}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_WHERE[name], __name__), name)
    globals()[name] = value  # once
    return value


def __dir__():
    return sorted(list(globals()) + __all__)


class _Package(types.ModuleType):
    """Importing the submodule `calibrate` binds it on the package over the function of the same name (what
    `from .calibrate import calibrate` used to undo at import time): the package keeps the function; the
    submodule stays reachable as sys.modules["infinigen_kv.calibrate"] and by `from .calibrate import ...`."""

    def __setattr__(self, name, value):
        if name in _WHERE and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
