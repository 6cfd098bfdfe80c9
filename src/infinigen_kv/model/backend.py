"""The backend: one value, built when a model is loaded (`build`, from the CLI's flags, the API's arguments and the
machine) and passed down to whatever reads it (the model's `Step`, a cache's layers); nothing looks it up elsewhere.
It holds what runs and every number that decides how:

- `ops`: the compiled CPU kernels (kernels/: a source file per kernel, prefill.cpp) or None: PyTorch's ops (the reference path, what
  the kernels are tested against, and what a GPU runs);
- `path`: the kernel path: "avx512-bf16" (AVX-512 with BF16: bfloat16 products), "avx512", "avx2", "generic" (the
  kernels without either), "reference" (no kernels), or the device type ("cuda");
- the products: `bf16_products` (a decode step's and a prompt chunk's linears on bfloat16 weights in bfloat16
  products), `int_prefill` (a prompt chunk's linears on int4 and int5 tiles and int8 rows in integer products, its
  activations in int8 as a decode step's), `bf16_attention` (a prompt chunk over a long past in bfloat16 products),
  `attend_pairs_upto` (decode attention over long bfloat16 rows in bfloat16 pairs for up to this many query heads a
  KV head, else float32 products of widened rows), `silu_lanes`;
- `head_ns`: the cost InfiniGen's dense-or-speculate rule gives a (past token, query head) of attention;
- `threads`: None (decode steps follow the machine's load, runtime/threads.py) or a fixed count;
- `cuda_graph`: on CUDA, one replayed graph a decode step (model/static.py); `cuda_fetch`: how InfiniGen's chosen
  rows reach the GPU: "uva" (the side stream reads the pinned pool through a device view) or "worker" (a host
  thread gathers them; INFINIGEN_CUDA_FETCH=worker, for a GPU or driver without mapped memory).

What decides outputs is a fact of the path, never a timing: `head_ns` and `attend_pairs_upto` are constants per
kernel path (PATHS), each from the measurement docs/BENCHMARKS.md records ("Never slower than full"): a timing
taken at first use moved with the machine's load (45.6 ns where a quiet machine measured 1.9) and, kept, changed
every later run's answers. A busy machine now runs slower, never otherwise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from . import kernels as kernel_library


@dataclass(frozen=True, slots=True)
class PathFacts:
    head_ns: float  # wall ns of decode attention per (past token, query head) at 64 channels, 2 threads, warm rows
    attend_pairs_upto: int = 0  # query heads a KV head up to which bfloat16 pairs serve (AVX-512 BF16 only)


# head_ns, from scripts/dev/head_ns.py on quiet 2-core machines (docs/BENCHMARKS.md, "Never slower than full": what the
# rule decides with them): "avx512-bf16" AMD EPYC (Zen 4), 1.86; "avx512" Intel Xeon (Emerald Rapids, no BF16), 2.16
# (its quiet runs spread 1.45-2.6 between minutes on a shared VM: a constant, not a timing, keeps the answer); "avx2"
# the kernels built for Haswell (-march=haswell) on that Xeon, 4.4; "generic" as avx2. attend_pairs_upto: on Zen 4
# bfloat16 pairs beat widened rows at every head count measured (1-8); on Intel's AVX-512 BF16 (Sapphire / Emerald
# Rapids) vdpbf16ps issues one every ~2.2 cycles and pairs win at 1-2 heads only (INTEL_PAIRS_UPTO).
PATHS = {
    "avx512-bf16": PathFacts(head_ns=1.86, attend_pairs_upto=8),
    "avx512": PathFacts(head_ns=2.16),
    "avx2": PathFacts(head_ns=4.4),
    "generic": PathFacts(head_ns=4.4),
}
INTEL_PAIRS_UPTO = 2


@dataclass(frozen=True, slots=True)
class Backend:
    device_type: str = "cpu"
    path: str = "reference"
    ops: Any = None  # the compiled kernels, or None: PyTorch ops
    silu_lanes: int | None = None  # silu_mul's vector width where it gives F.silu's bits; None: PyTorch's silu
    bf16_products: bool = False
    int_prefill: bool = False
    bf16_attention: bool = False
    attend_pairs_upto: int = 0
    head_ns: float = 0.0  # 0: the rule weighs bytes alone (no kernels: PyTorch's attention)
    threads: int | None = None
    cuda_graph: bool = True
    cuda_fetch: str = "uva"

    @property
    def kernels(self) -> bool:
        """Whether the compiled kernels run here (int8 partial keys, attention over the pool in place, the fused
        decode layer)."""
        return self.ops is not None

    @property
    def name(self) -> str:
        """"cpu-kernels", "reference" (CPU without the kernels) or the device type."""
        if self.device_type != "cpu":
            return self.device_type
        return "cpu-kernels" if self.ops is not None else "reference"

    def on(self, device_type: str) -> Backend:
        """This backend for another device type (a CPU pool layer beside CUDA compute, a model moved): the same
        settings, that device's operations."""
        if device_type == self.device_type:
            return self
        return build(device_type, kernels=False if self.device_type == "cpu" and self.ops is None else None,
                     threads=self.threads, cuda_graph=self.cuda_graph)

    def __deepcopy__(self, memo) -> Backend:
        return self  # a value: a copied cache (a fork) runs the same operations


def build(device: str = "cpu", *, kernels: bool | None = None, bf16_products: bool | None = None,
          threads: int | None = None, cuda_graph: bool = True, attend_pairs_upto: int | None = None) -> Backend:
    """The backend of a model on `device` ("cpu", "cuda", a torch.device): kernels None: the compiled CPU kernels
    where built, unless INFINIGEN_KERNELS=0; bf16_products None: where the CPU multiplies bfloat16 in hardware,
    unless INFINIGEN_BF16_PRODUCTS=0; integer products in a prompt chunk where the CPU's flags say
    (int_prefill_native), unless INFINIGEN_INT_PREFILL=0 (user settings, read here, at load, as INFINIGEN_CUDA_FETCH on CUDA); threads: a fixed
    count (None: follow the load); attend_pairs_upto: the path's constant unless given (experiments)."""
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if kind != "cpu":
        fetch = os.environ.get("INFINIGEN_CUDA_FETCH", "uva")
        return Backend(kind, kind, threads=threads, cuda_graph=cuda_graph, cuda_fetch=fetch)
    if kernels is None:
        kernels = os.environ.get("INFINIGEN_KERNELS", "1") != "0"
    if bf16_products is None:
        bf16_products = os.environ.get("INFINIGEN_BF16_PRODUCTS", "1") != "0" and native_bf16()
    ops = kernel_library.library() if kernels else None
    if ops is None:
        return Backend("cpu", "reference", bf16_products=bf16_products, threads=threads, cuda_graph=cuda_graph)
    path = kernel_path(ops)
    facts = PATHS[path]
    pairs = facts.attend_pairs_upto
    if path == "avx512-bf16" and kernel_library.cpu_vendor() == "GenuineIntel":
        pairs = INTEL_PAIRS_UPTO
    if attend_pairs_upto is not None:
        pairs = attend_pairs_upto
    lanes = kernel_library.silu_lanes() if kernel_library.silu_mul_exact(ops) else None
    int_prefill = int_prefill_native() and os.environ.get("INFINIGEN_INT_PREFILL", "1") != "0"
    return Backend("cpu", path, ops, lanes, bf16_products, int_prefill, ops.bf16_dots_native(),
                   pairs if ops.bf16_dots_native() else 0, facts.head_ns, threads, cuda_graph)


def reference(device: str = "cpu", **kw) -> Backend:
    """The backend without the compiled kernels: PyTorch's ops (what a GPU runs; what the kernels are tested
    against)."""
    return build(device, kernels=False, **kw)


def kernel_path(ops) -> str:
    """The kernel path of a build on this CPU (the kernels are compiled with -march=native: the CPU's flags are its)."""
    if ops.bf16_dots_native():
        return "avx512-bf16"
    flags = set(kernel_library.cpu_flags_line().split())
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if "avx2" in flags else "generic"


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX, where oneDNN's bfloat16 GEMM is ~2.5x
    its float32 one). Without them oneDNN emulates it, slower than float32."""
    return bool(set(kernel_library.cpu_flags_line().split()) & {"avx512_bf16", "amx_bf16"})


def int_prefill_native() -> bool:
    """Whether a prompt chunk's quantized weights multiply in the linear kernel's integer products here: where the
    kernels have 512-bit VNNI (dpbusd: 64 int8 products an instruction, twice vdpbf16ps' 32), as on AMD's Zen 4 (the
    0.5B's linears 1.11-1.89x oneDNN's bfloat16 GEMM on their weights dequantized, a 4k prefill 1.32-1.61x:
    docs/BENCHMARKS.md, "Prefill: integer products"), but
    not beside AMX, whose bfloat16 GEMM oneDNN runs on its tiles; without 512-bit VNNI (AVX2) the GEMM stays."""
    flags = set(kernel_library.cpu_flags_line().split())
    return {"avx512_vnni", "avx512bw"} <= flags and "amx_bf16" not in flags
