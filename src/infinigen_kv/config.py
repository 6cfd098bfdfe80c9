"""The options and defaults: InfiniGenConfig (the method's knobs, named as in the paper, validated on construction),
the default model and budgets, and where infinigen-kv keeps its files. No tensor code (the CLI parses without torch)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


DEFAULT_MODEL = "SmolLM2-135M-Instruct"  # what load_model(None) loads (model/load.py: from a wheel's GGUF)
DEFAULT_METHOD = "infinigen"  # the KV-cache method the CLI, the server and make_cache users get by default
DEFAULT_BUDGET = 0.1  # InfiniGen's budget, and the fixed budget of h2o/streaming unless one is given
# The floor under a fractional budget, in tokens: a budget never fetches (or keeps) fewer than this many entries,
# or the whole past when it is shorter: 10% of a short past is a few tokens per head, which no selection survives,
# and reading a short past whole costs little (docs/BENCHMARKS.md, "The budget floor").
DEFAULT_MIN_BUDGET = 1024


PARTIAL_DTYPES = ("auto", "int8", "bfloat16", "float32", "model")
KV_DTYPES = ("auto", "float32", "bfloat16", "int8")  # the storage of K/V rows (kv_dtype; "auto": model/kv.kv_storage)
LOCAL_LAYERS = ("dense", "speculate")  # the choices of InfiniGenConfig.local_layers
LAYER_BUDGETS = ("uniform", "recall")  # the choices of InfiniGenConfig.layer_budget
SPECULATE_FROM = ("auto", "previous", "own")  # the choices of InfiniGenConfig.speculate_from


class ConfigError(ValueError):
    """A knob is outside its valid range; the message names the knob and the range."""


@dataclass(frozen=True)
class InfiniGenConfig:
    # alpha: a past token is fetched when its speculated score is within `alpha` of the row's maximum,
    # i.e. its softmax weight is at least e^-alpha of the largest. Larger alpha = more tokens fetched.
    # The paper uses 4-5 (OPT, Llama-2); the default model's diffuse attention needs more
    # (docs/BENCHMARKS.md, "Tuning InfiniGen's defaults").
    alpha: float = 12.0
    # partial_ratio: share of the head dimension kept as partial query/key channels (|P| = ceil(ratio*d)).
    # The paper uses 0.2-0.3; a small head (SmolLM2: d = 64) needs more (docs/BENCHMARKS.md, "Tuning InfiniGen's
    # defaults"). Cost: the partial key cache is ratio/2 of the K+V bytes.
    partial_ratio: float = 0.5
    # budget: cap on the fetched tokens per (sequence, KV head, layer): a fraction of the past length in
    # (0, 1], or a token count (an integer > 1, e.g. 1024: at most that many, the field's usual unit).
    # 0.1, the paper's 0.2 halved (docs/BENCHMARKS.md, "Accuracy").
    budget: float = DEFAULT_BUDGET
    # min_budget: a fractional budget's floor in tokens: each (sequence, KV head, layer) fetches up to
    # max(budget x past, min_budget) entries, the whole past when it is shorter, and a step whose cap leaves
    # nothing to save (the fetched rows plus the partial keys would read as many bytes as the whole past)
    # attends densely without speculating. 0 turns the floor off (a budget sweep: each budget as named). A token
    # count budget is not floored (docs/BENCHMARKS.md, "The budget floor").
    min_budget: int = DEFAULT_MIN_BUDGET
    # min_saving: on CPU, a decode step speculates only where the bytes it saves (all K/V rows, less the partial
    # keys, the chosen rows (read scattered), the partial queries' weights and a fixed cost a speculating layer) are
    # at least this share of the step's bytes (weights + K/V); below it the step attends densely, as full does.
    # 0: the rule off, speculating wherever a layer's cap leaves rows out, as min_budget 0 (no floor: a budget
    # sweep) does (docs/BENCHMARKS.md, "Never slower than full").
    min_saving: float = 0.02
    # max_num_kv: optional absolute cap on fetched tokens per (sequence, KV head, layer).
    max_num_kv: int | None = None
    # gqa_combine: how the r query heads of a KV group vote for tokens: "max" (any head wants it) or
    # "mean" of their logits relative to each head's maximum.
    gqa_combine: str = "max"
    # speculate_from: which input speculates a layer's fetch. "previous" (the paper): layer l+1's at layer l's
    # attention input, so the fetch overlaps layer l's compute on a GPU; "own": each layer at its own query, just
    # before it attends (its exact partial query, the query's skewed channels, where "previous" predicts it from
    # layer l's input through layer l+1's q_proj rows; nothing overlaps: on CPU the rows are read in place and
    # there is nothing to hide); "auto": "own" on CPU, "previous" on a GPU (`speculation_source`).
    speculate_from: str = "auto"
    # calibration: path of a calibration file to use; None = the per-model cache (calibrating on first use).
    calibration: str | None = None
    # calibration_text: a text file to calibrate on; None = the built-in default text.
    calibration_text: str | None = None
    # channel_rule: how partial channels are ranked: "q" (|Q| summed, the paper's code) or "qk"
    # (mean|Q| x mean|K|, which predicted attention better on our measurements).
    channel_rule: str = "qk"
    # capacity: the host pool keeps at most capacity x (tokens seen) entries per layer and sequence; None =
    # every entry. capacity_bytes: the same as a byte limit of the K+V rows per layer and sequence. When the
    # pool is full each new token overwrites one entry chosen by `eviction`: "fifo" (oldest), "lru" (least
    # recently fetched) or "counter" (fewest fetches; the paper's default). Evicted entries are gone for good.
    # Layer 0 attends fully from the device and is not limited.
    capacity: float | None = None
    capacity_bytes: int | None = None
    eviction: str = "counter"
    # skew: "svd" (the paper's skewing matrices), "none" (raw channels), or "auto": "none" for RoPE
    # models, where it measured better, and "svd" for models without RoPE (OPT).
    skew: str = "auto"
    # partial_dtype: storage of the partial key cache, which only ranks tokens. "int8": rows quantized by their
    # absmax with the scale stored in the row, scored by integer dot products (a quarter of float32's bytes;
    # methods/infinigen/int8.py; RULER at 4k and 8k equal to bfloat16's). "bfloat16": half the bytes, scores in
    # float32. "float32": as computed. "model": the model's dtype. "auto" = int8 for a float32 model on CPU with
    # the compiled kernels, bfloat16 on a GPU (half float32's device memory: 4.3 GB at B4 x 32k on Llama-3.1-8B's shape; each key
    # widened as read, partial_scores.py), float32 otherwise. Scores are computed in float32 on every device: alpha
    # and every figure were tuned on float32 scores, and bf16 logits (steps of 0.125-0.25 at 20-40) make ties of
    # the top-k order.
    partial_dtype: str = "auto"
    # kv_dtype: the storage of the K/V rows of the pool and of the device layers. "auto": bfloat16 for a float32
    # model on CPU (half the bytes a token, attention computed in float32 over the rows as stored; RULER, perplexity
    # and passkey as float32's: docs/BENCHMARKS.md), the model's dtype otherwise; "float32", "bfloat16" as named;
    # "int8": llama.cpp's q8_0 in a row, groups of 32 values with a float16 scale each (model/int8_rows.py: 68 bytes
    # a row of 64, 0.53x bfloat16's).
    kv_dtype: str = "auto"
    # local_layers: what InfiniGen does on the local (sliding-window) layers of a model that also has global
    # ones (Gemma 3): "dense" attends each one's whole window, kept with the layer, as layer 0;
    # "speculate" selects within the window like any layer (the budget then counts the window's tokens;
    # docs/BENCHMARKS.md, "Models: Gemma 3 270M").
    local_layers: str = "dense"
    # layer_budget: how the budget is shared among the speculated layers: "uniform" (each layer fetches up to
    # the budget) or "recall": a layer gets budget x its share of the speculation's misses (1 - recall,
    # measured once per model on the calibration text and kept in the calibration file; within 0.5x-3x), the
    # layers' mean unchanged: a retrieval layer the partial channels predict worst is where a needle is lost.
    # Opt-in: it helps some models, not others (docs/BENCHMARKS.md, "RULER", "Per-layer budget").
    layer_budget: str = "uniform"

    def __post_init__(self):
        check_budget(self.budget)
        check_min_budget(self.min_budget)
        check_fraction("partial_ratio", self.partial_ratio)
        if isinstance(self.min_saving, bool) or not (0.0 <= self.min_saving < 1.0):
            raise ConfigError(f"min_saving must be a share of a step's bytes in [0, 1), got {self.min_saving!r}")
        if not (self.alpha > 0):
            raise ConfigError(f"alpha must be > 0, got {self.alpha}")
        if self.max_num_kv is not None and self.max_num_kv < 1:
            raise ConfigError(f"max_num_kv must be >= 1, got {self.max_num_kv}")
        if self.gqa_combine not in ("max", "mean"):
            raise ConfigError(f"gqa_combine must be 'max' or 'mean', got {self.gqa_combine!r}")
        if self.speculate_from not in SPECULATE_FROM:
            raise ConfigError(f"speculate_from must be one of {', '.join(SPECULATE_FROM)}, got {self.speculate_from!r}")
        if self.local_layers not in LOCAL_LAYERS:
            raise ConfigError(f"local_layers must be one of {', '.join(LOCAL_LAYERS)}, got {self.local_layers!r}")
        if self.layer_budget not in LAYER_BUDGETS:
            raise ConfigError(f"layer_budget must be one of {', '.join(LAYER_BUDGETS)}, got {self.layer_budget!r}")
        if self.skew not in ("auto", "svd", "none"):
            raise ConfigError(f"skew must be 'auto', 'svd' or 'none', got {self.skew!r}")
        if self.capacity is not None:
            check_fraction("capacity", self.capacity)
        if self.capacity_bytes is not None and not (isinstance(self.capacity_bytes, int) and self.capacity_bytes > 0):
            raise ConfigError(f"capacity_bytes must be a positive integer, got {self.capacity_bytes!r}")
        if self.eviction not in ("fifo", "lru", "counter"):
            raise ConfigError(f"eviction must be 'fifo', 'lru' or 'counter', got {self.eviction!r}")
        check_kv_dtype(self.kv_dtype)
        if self.partial_dtype not in PARTIAL_DTYPES:
            raise ConfigError(f"partial_dtype must be one of {', '.join(PARTIAL_DTYPES)}, got {self.partial_dtype!r}")
        if self.channel_rule not in ("q", "qk"):
            raise ConfigError(f"channel_rule must be 'q' or 'qk', got {self.channel_rule!r}")


def speculation_source(choice: str, device_type: str) -> str:
    """The input a cache speculates its layers' fetches from, for speculate_from `choice` on a device of
    `device_type`: "auto" is the layer's "own" query on CPU, where the rows are read in place and no fetch has a
    compute to hide behind (and its exact partial query chooses better: docs/BENCHMARKS.md, "RULER at 16k tokens,
    the 0.5B"), and the "previous" layer's input on a GPU, where the fetch overlaps that layer's compute."""
    if choice != "auto":
        return choice
    return "own" if device_type == "cpu" else "previous"


def check_budget(value) -> None:
    """A budget is a fraction of each sequence's past in (0, 1], or a token count: an integer > 1."""
    try:
        v = float(value)
        ok = 0.0 < v <= 1.0 or (v > 1 and v == int(v))
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok or isinstance(value, (str, bool)):  # "0.5" would pass float() and fail later, far from here
        raise ConfigError(f"budget must be a fraction in (0, 1] or a token count (an integer > 1), got {value!r}")


def check_kv_dtype(value) -> None:
    if value not in KV_DTYPES:
        raise ConfigError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {value!r}")


def check_min_budget(value) -> None:
    """The floor of a fractional budget: a whole number of tokens >= 0 (0: no floor)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"min_budget must be a token count >= 0 (0: no floor), got {value!r}")


def check_fraction(name: str, value: float) -> None:
    """Knobs that are shares of something live in (0, 1]."""
    try:
        ok = 0.0 < float(value) <= 1.0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"{name} must be in (0, 1], got {value}")


def cache_dir() -> Path:
    """User cache directory (INFINIGEN_CACHE_DIR, else $XDG_CACHE_HOME/infinigen_kv, else ~/.cache/infinigen_kv)."""
    root = os.environ.get("INFINIGEN_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "infinigen_kv"
