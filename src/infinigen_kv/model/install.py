"""Everything infinigen-kv installs on a transformers model, in one place, once per model:

- the attention function and mask function named "infinigen" (attention.py), set as the model's attention;
- every layer's self_attn forward: with a cache of ours (one with `before_attention`) the attention block
  (attention.py: the cache's speculation, q/k/v, `cache.update`, the attention function, the output projection),
  which the decode step (step.py) runs too; with any other cache the model's own forward;
- hooks that keep what a forward computes once for all layers (arch.StepInputs: the mask, per-type RoPE);
- on CPU, the fast linears of decode steps (`fast_cpu_linears`, by load_model).
"""

from __future__ import annotations

import contextvars
import types

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import backend as backends
from . import int8_rows
from .arch import Arch, get_arch, step_inputs
from .attention import attention_block, infinigen_attention
from .kv import StepCache

NAME = "infinigen"
HOOK_KWARGS = ("hidden_states", "position_embeddings", "attention_mask", "past_key_values")  # what the forward reads


def _attention_forward(self, *args, **kwargs):
    """A self_attn's forward: with one of our caches the attention block (attention.py), the model's own forward
    otherwise. Bound to the module (a deep copy of the model gets its own, with its copy of the Arch)."""
    cache = kwargs.get("past_key_values")
    if not isinstance(cache, StepCache):  # not one of our caches
        return type(self).forward(self, *args, **kwargs)
    h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    return attention_block(self._infinigen_arch, cache, self.layer_idx, h, kwargs.get("position_embeddings"),
                           kwargs.get("attention_mask")), None


def register() -> None:
    AttentionInterface.register(NAME, infinigen_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # without this, padding would be silently ignored


def install(model) -> Arch:
    """Hooks + attention implementation on `model`, once (idempotent); its Arch, made once (UnsupportedModelError
    for an architecture without an adapter). Cheap once installed: the decode step asks for it every step."""
    if getattr(model, "_infinigen_installed", False):
        return model._infinigen_arch
    arch = get_arch(model)
    register()
    arch.step = step_inputs(model, arch.base)
    for attn in arch.attns:
        attn._infinigen_arch = arch
        attn.forward = types.MethodType(_attention_forward, attn)
    try:
        model.set_attn_implementation(NAME)
    except Exception:
        model.config._attn_implementation = NAME
    model._infinigen_arch = arch  # (a deep copy of the model gets its copy, with its own modules)
    model._infinigen_installed = True
    return arch


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
    prompt alone and the same prompt in a batch would differ in the last bits (and flip near-tie selections)."""
    if rows == 0:  # no position kept (logits_to_keep: a chunk before the last)
        return x.new_empty(*x.shape[:-1], self.out_features)
    if rows >= PREFILL_MIN_ROWS or not x.is_cpu:
        return linear(x, self.weight, self.bias)
    padded = x.new_zeros(PREFILL_MIN_ROWS, x.shape[-1])
    padded[:rows] = x.reshape(rows, -1)
    return linear(padded, self.weight, self.bias)[:rows].reshape(*x.shape[:-1], -1)


CONVERT_ELEMENTS = 1 << 24  # most weights converted to float32 at once (64 MB): the LM head of a large vocabulary


def dense(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values of a weight as held, in `dtype`: int8 rows (int8_weights) dequantized, others converted."""
    return int8_rows.unpacked_kv(w, dtype) if w.dtype == torch.int8 else w.to(dtype)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear of x with w as it is held: a bfloat16 weight of a float32 model is converted for the call, int8
    rows dequantized (the BLAS then computes as with float32 weights of the same values; ~3% of a 2,048-row
    product), in slices of its output rows where it is large, so the conversion never holds a float32 copy of a
    whole LM head."""
    if w.dtype == x.dtype:
        return torch.nn.functional.linear(x, w, bias)
    step = max(1, CONVERT_ELEMENTS // w.shape[1])
    if w.shape[0] <= step:
        return torch.nn.functional.linear(x, dense(w, x.dtype), bias)
    parts = [(w[s : s + step], None if bias is None else bias[s : s + step]) for s in range(0, w.shape[0], step)]
    return torch.cat([torch.nn.functional.linear(x, dense(wp, x.dtype), bp) for wp, bp in parts], dim=-1)


def _lm_head_linear(self, x: torch.Tensor) -> torch.Tensor:
    """The LM head: as every linear, but a prefill's rows over the last position of each sequence (B rows, as in
    decode) go through the kernel, which reads bfloat16 or int8 rows once where converting them for the BLAS would
    write a float32 copy of a whole vocabulary for every prompt."""
    rows = x.numel() // x.shape[-1]
    if _prefilling.get() and 0 < rows <= SMALL_BATCH and self.weight.dtype != torch.float32 \
            and x.dtype == torch.float32 and x.is_cpu and (kern := backends.cpu().ops) is not None:
        return kern.linear(x.reshape(rows, -1).contiguous(), self.weight, self.bias).view(*x.shape[:-1], -1)
    return _small_batch_linear(self, x)


def _small_batch_linear(self, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward, with decode-sized inputs (a few rows) through the `linear` kernel (which reads a
    bfloat16 weight as it lies) or, float32 weights, computed as (W x^T)^T; prefills by the BLAS. Runs ~200
    times a decode step: the checks are ordered cheapest first."""
    rows = x.numel() // x.shape[-1]
    if _prefilling.get():  # one path whatever the batch (see _prefill_linear)
        return _prefill_linear(self, x, rows)
    w = self.weight
    if rows > SMALL_BATCH or not x.is_cpu or x.dtype != torch.float32:
        return linear(x, w, self.bias)
    held = w.dtype != torch.float32  # bfloat16 or int8 rows: the kernel reads them as they lie
    if rows <= (SMALL_BATCH if held else KERNEL_ROWS) and (kern := backends.cpu().ops) is not None:
        y = kern.linear(x.view(rows, -1) if x.is_contiguous() else x.reshape(rows, -1).contiguous(), w, self.bias)
        return y.view(*x.shape[:-1], -1)
    if rows < 2 or held:
        return linear(x, w, self.bias)
    y = torch.mm(w, x.reshape(rows, -1).t()).t()  # (rows, out)
    if self.bias is not None:
        y = y + self.bias
    return y.reshape(*x.shape[:-1], -1)


SMALL_BATCH = 32  # rows up to which W x^T beats x W^T (measured: batch 2-32), and the kernel a converted weight
# Rows up to which the `linear` kernel beats the BLAS on float32 weights (docs/benchmarks-history.md, "Decode linears").
KERNEL_ROWS = 8


RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm", "Qwen3RMSNorm")  # x / rms(x) * w (not Gemma's 1 + w)


def _fast_rms_norm(self, x: torch.Tensor) -> torch.Tensor:
    """A Llama-style RMSNorm of float32 x on CPU as one `rms_norm` kernel call (the module's forward is ~6 ops,
    ~20 us at decode sizes, 61 times a step); other inputs through the module's own forward."""
    if x.dtype == torch.float32 and x.is_cpu and (kern := backends.cpu().ops) is not None:
        return kern.rms_norm(x.contiguous(), self.weight, self.variance_epsilon)
    return type(self).forward(self, x)


def fast_cpu_linears(model, weights: str = "float32") -> None:
    """Decode steps through a float32 model's linear layers on CPU. A few rows (a decode step of a batch)
    are bound by reading the weights, which the CPU BLAS does at half the machine's bandwidth on these
    shapes: up to KERNEL_ROWS rows go through the `linear` kernel (one streamed read of each weight row for
    all rows), up to SMALL_BATCH as W @ x^T; prefills by the BLAS (at least PREFILL_MIN_ROWS rows).

    weights="bfloat16" (weight-only bfloat16, `--dtype bf16-weights`): the linear weights and the input
    embedding are held in bfloat16, once (bfloat16_weights); decode steps up to SMALL_BATCH rows read them
    through the kernel, prefills and larger batches convert them per call (`linear`). Activations and norms
    stay float32. Llama-style RMSNorms (RMS_NORMS) of float32 weights get the `rms_norm` kernel for every path
    (prefill and decode, the model's forward and model/step.py alike). Idempotent."""
    if not getattr(model, "_infinigen_phase_hook", False):
        model.register_forward_pre_hook(_note_phase, with_kwargs=True)
        model._infinigen_phase_hook = True
    if weights == "bfloat16":
        bfloat16_weights(model)
    elif weights == "int8":
        int8_weights(model)
    head = model.get_output_embeddings()
    for module in model.modules():
        if type(module).__name__ in RMS_NORMS and module.weight.dtype == torch.float32 and "forward" not in vars(module):
            module.forward = types.MethodType(_fast_rms_norm, module)  # every path through the model, prefill too
        if type(module) is torch.nn.Linear and not getattr(module, "_infinigen_fast", False):
            module.forward = types.MethodType(_lm_head_linear if module is head else _small_batch_linear, module)
            module._infinigen_fast = True


def bfloat16_weights(model) -> None:
    """Hold a model's linear weights and its input embedding in bfloat16, one copy (a tied LM head stays tied
    to the embedding), and every other parameter and buffer (norms, biases, learned positions) in float32: the
    model computes in float32 over bfloat16 weights, as load_model loads it (in bfloat16, then this). A float32
    weight is rounded once; the embedding's forward returns float32 rows (`_float32_embedding`)."""
    _hold_weights(model, torch.bfloat16, lambda w: w.to(torch.bfloat16))


def int8_weights(model, values: bool = True) -> None:
    """Hold a model's linear weights and its input embedding as int8 rows, one copy (`--weights int8`): each
    weight row in llama.cpp's q8_0 layout (int8_rows.pack_kv: groups of 32 values, a float16 scale each, 1.06 bytes
    a weight), quantized from the values as held; everything else as bfloat16_weights holds it. The decode
    kernels read the rows as they lie; prefills dequantize them in slices (`linear`). Weights already held as int8
    rows are kept. values=False: the rows allocated, not filled (a streamed load quantizes into them)."""
    def empty(w):
        return torch.empty(w.shape[0], int8_rows.kv_width(w.shape[1]), dtype=torch.int8)

    _hold_weights(model, torch.int8, int8_rows.pack_kv if values else empty)


def _hold_weights(model, dtype: torch.dtype, convert) -> None:
    held = {}
    embedding = model.get_input_embeddings()
    for module in model.modules():
        if type(module) is torch.nn.Linear or module is embedding:
            w = module.weight
            if id(w) not in held:
                held[id(w)] = w if w.dtype == dtype else torch.nn.Parameter(convert(w.detach()), requires_grad=False)
            module.weight = held[id(w)]
    kept = {id(w) for w in held.values()}
    with torch.no_grad():
        for p in model.parameters():
            if id(p) not in kept and p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.float()
        for module in model.modules():
            for name, b in module.named_buffers(recurse=False):
                if b is not None and b.is_floating_point() and b.dtype != torch.float32:
                    module._buffers[name] = b.float()
    scaled = isinstance(getattr(embedding, "scalar_embed_scale", None), float)  # Gemma's sqrt(D)
    if scaled:  # (its buffer was made in bfloat16 where the model was built in it)
        embedding.embed_scale = torch.tensor(embedding.scalar_embed_scale, dtype=torch.float32)
    forwards = {torch.bfloat16: (_float32_embedding, _float32_scaled_embedding),
                torch.int8: (_int8_embedding, _int8_scaled_embedding)}[dtype]
    embedding.forward = types.MethodType(forwards[scaled], embedding)
    model.__dict__.pop("_infinigen_merged", None)  # the decode step's merged matrices (step.py) follow the weights
    model._infinigen_weights = dtype


def _int8_embedding(self, ids: torch.Tensor) -> torch.Tensor:
    """The input embedding of int8 rows: the rows of ids, dequantized to float32."""
    return int8_rows.unpacked_kv(torch.nn.functional.embedding(ids, self.weight, self.padding_idx), torch.float32)


def _int8_scaled_embedding(self, ids: torch.Tensor) -> torch.Tensor:
    """The same for an embedding with a scale (Gemma's sqrt(D))."""
    return _int8_embedding(self, ids) * self.embed_scale


def _float32_embedding(self, ids: torch.Tensor) -> torch.Tensor:
    """The input embedding of a model with bfloat16 weights: the rows as held, in float32."""
    return torch.nn.functional.embedding(ids, self.weight, self.padding_idx).float()


def _float32_scaled_embedding(self, ids: torch.Tensor) -> torch.Tensor:
    """The same for an embedding with a scale (Gemma's sqrt(D)), applied in float32 as a float32 model does."""
    return torch.nn.functional.embedding(ids, self.weight, self.padding_idx).float() * self.embed_scale


def compute_dtype(model) -> torch.dtype:
    """The dtype a model computes in: float32 for bfloat16 weights or int8 rows in a float32 model
    (bfloat16_weights, int8_weights), otherwise its parameters'."""
    if getattr(model, "_infinigen_weights", None) is not None:
        return torch.float32
    return next(model.parameters()).dtype
