"""infinigen-kv: InfiniGen's speculative KV-cache selection over a host KV pool, for transformers models."""

from .baselines import METHODS, make_cache
from .cache import InfiniGenCache
from .calibrate import Calibration, CalibrationError, calibrate
from .config import ConfigError, InfiniGenConfig
from .generation import generate
from .models import load_model

__all__ = [
    "InfiniGenCache", "InfiniGenConfig", "ConfigError", "Calibration", "CalibrationError", "calibrate",
    "make_cache", "METHODS", "generate", "load_model",
]
__version__ = "0.1.0"
