"""The backend of a compute device: which implementation of the decode step's operations runs there, chosen once
per device (and per INFINIGEN_KERNELS setting) and asked by every call site.

- "cpu-kernels": the compiled CPU kernels (kernels/cpu.cpp): `linear`, `rms_norm`, `rope_`, `silu_mul`,
  `speculate`, `partial_query`, `quantize_rows`, `store_token`, `attend` (reading the pool in place), and
  `prefill_attend` (kernels/prefill.cpp: a prompt chunk over a long past);
- "reference": PyTorch's ops on CPU (INFINIGEN_KERNELS=0, or no compiler): what the kernels are tested against;
- "cuda": PyTorch's ops on a GPU.

A call site asks `for_device(device)` (or takes the backend its layer was made with) and runs `backend.ops.X` where
`backend.ops` is not None, its PyTorch twin otherwise; nothing else looks the kernels up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import kernels


@dataclass(frozen=True, slots=True)
class Backend:
    name: str  # "cpu-kernels" | "reference" | "cuda" | the device type
    device_type: str
    ops: Any = None  # the compiled kernels (kernels/cpu.cpp), or None: PyTorch ops
    silu_lanes: int | None = None  # silu_mul's vector width where it gives F.silu's bits; None: PyTorch's silu
    bf16_products: bool = False  # products with weights held in bfloat16 (or int8 rows, a prompt's) run in bfloat16:
    # a prompt chunk's and a decode step's linears (the CPU multiplies it natively: AVX-512 BF16 or AMX;
    # INFINIGEN_BF16_PRODUCTS=0 keeps float32)
    bf16_attention: bool = False  # the kernels attend a prompt chunk over a long past in bfloat16 products
    # (ops.prefill_attend, built with AVX-512 BF16); a decode query's products follow kernels.attend_pairs_upto

    @property
    def kernels(self) -> bool:
        """Whether the compiled kernels run here (int8 partial keys, attention over the pool in place, the fused
        decode layer)."""
        return self.ops is not None

    def __deepcopy__(self, memo) -> Backend:
        return self  # one per device for the process: a copied cache (a fork) runs the same operations


_chosen: dict = {}


def for_device(device: torch.device | str) -> Backend:
    """The backend of `device` (its type: every GPU of a machine runs the same ops)."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    key = (kind, kernels.enabled())
    if key not in _chosen:
        _chosen[key] = _choose(kind)
    return _chosen[key]


def cpu() -> Backend:
    """The CPU's backend (asked ~200 times a decode step by the linears: one dict lookup)."""
    return _chosen.get(("cpu", kernels.enabled())) or for_device("cpu")


def _choose(kind: str) -> Backend:
    if kind != "cpu":
        return Backend(kind, kind)
    ops, bf16 = kernels.cpu(), native_bf16()
    if ops is None:
        return Backend("reference", kind, bf16_products=bf16)
    return Backend("cpu-kernels", kind, ops, kernels.silu_lanes() if kernels.silu_mul_exact() else None, bf16,
                   ops.bf16_dots_native())


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX, where oneDNN's bfloat16 GEMM is ~2.5x
    its float32 one), unless INFINIGEN_BF16_PRODUCTS=0. Without them oneDNN emulates it, slower than float32."""
    import os

    if os.environ.get("INFINIGEN_BF16_PRODUCTS", "1") == "0":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})
