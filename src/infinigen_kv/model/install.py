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
    prompt alone and the same prompt in a batch would differ in the last bits (and flip near-tie
    selections, issue 13)."""
    if rows == 0:  # no position kept (logits_to_keep: a chunk before the last)
        return x.new_empty(*x.shape[:-1], self.weight.shape[0])
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
    if rows <= (KERNEL_ROWS if w16 is None else KERNEL_ROWS_BF16) and (kern := backends.cpu().ops) is not None:
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
# Rows up to which the `linear` kernel beats the BLAS (docs/benchmarks-history.md, "Decode linears").
KERNEL_ROWS = 8
KERNEL_ROWS_BF16 = 16


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

    weights="bfloat16" (weight-only bfloat16, `--dtype bf16-weights`): every linear weight is rounded to
    bfloat16 values (kept in float32 for prefill and larger batches, so every path sees the same weights)
    and a bfloat16 copy serves decode steps through the kernel, which reads half the bytes. Activations,
    norms and the KV cache stay float32. Llama-style RMSNorms (RMS_NORMS) of float32 weights get the `rms_norm`
    kernel for every path (prefill and decode, the model's forward and model/step.py alike). Idempotent."""
    if not getattr(model, "_infinigen_phase_hook", False):
        model.register_forward_pre_hook(_note_phase, with_kwargs=True)
        model._infinigen_phase_hook = True
    model.__dict__.pop("_infinigen_merged", None)  # the decode step's merged matrices (step.py) follow the weights
    for module in model.modules():
        if type(module).__name__ in RMS_NORMS and module.weight.dtype == torch.float32 and "forward" not in vars(module):
            module.forward = types.MethodType(_fast_rms_norm, module)  # every path through the model, prefill too
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
