"""The CPU kernels of the decode step (speculate, attend, linear, dequantize, partial_query, kv_rows, elementwise: a
source file each, bindings.cpp the module), of a prompt chunk's attention over a long past (prefill.cpp) and of
H2O's prefill scores (column_sums.cpp, and prefill.cpp's in bfloat16 products),
compiled for the machine by the install step (`infinigen build-kernels`: `build()`), or at first use where the
install did not.

`library()` returns the compiled module, or None where it cannot be built (no C++ compiler). It is a library,
loaded once; whether a model runs it, and how, is its backend's (model/backend.py: built at load and passed down),
never a setting kept here. The build is cached by torch under ~/.cache/torch_extensions, keyed by the CPU's
instruction set (the code is compiled for the machine it runs on), so it happens once per machine and source (~60 s
on 2 cores).
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
from pathlib import Path

# one translation unit per kernel, compiled in parallel (ninja); the headers they include are in the build's key
_SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
_HEADERS = sorted(Path(__file__).parent.glob("*.h"))
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math", "-fopenmp"]
_module = None
_tried = False


def _cpu_key() -> str:
    """A short hash of the CPU's feature flags, the compiler flags and the source: a build for one instruction set (or
    another source) is never loaded for another."""
    text = "".join(p.read_text() for p in _SOURCES + _HEADERS)
    return hashlib.sha1((cpu_flags_line() + " ".join(_FLAGS) + text).encode()).hexdigest()[:10]


def cpu_flags_line() -> str:
    """The CPU's feature flags as /proc/cpuinfo lists them ("" where it is not there)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def cpu_vendor() -> str:
    """The CPU's vendor id ("GenuineIntel", "AuthenticAMD"; "" where /proc/cpuinfo does not say)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""
    return line.partition(":")[2].strip()


def library():
    """The compiled kernels (built here the first time where the install did not), or None: no compiler."""
    global _module, _tried
    if not _tried:
        _tried = True
        _module = _build()
    return _module


def silu_lanes() -> int:
    """The float32 vector width of PyTorch's CPU kernels (its CPU capability), which `silu_mul` follows to give
    F.silu's bits: 8 (AVX2), 16 (AVX-512), 0 (other: expf throughout)."""
    import torch

    return {"AVX2": 8, "AVX512": 16}.get(torch.backends.cpu.get_cpu_capability(), 0)


def silu_mul_exact(module) -> bool:
    """Whether the `silu_mul` kernel gives F.silu(gate) * up's bits on this machine (on values that take every path:
    vectors, the scalar tail, large and tiny magnitudes): a fact of the machine and build, the same at every check."""
    import torch

    g = torch.Generator().manual_seed(0)
    gu = torch.randn(3, 2 * 1000 + 2 * 13, generator=g) * torch.logspace(-3, 2, 2026)  # (3, 2F), F = 1013
    F = gu.shape[1] // 2
    return torch.equal(module.silu_mul(gu, silu_lanes()), torch.nn.functional.silu(gu[:, :F].contiguous()) * gu[:, F:])


def build() -> dict:
    """Compile the kernels for this machine now, once (the install step runs it, so no user's first command waits
    ~60 s for it): {"kernels": "built" | "already built" | "unavailable", "seconds", "path", "line": one line to
    print}. Without a C++ compiler (or ninja) the PyTorch path serves, slower, and the line says so."""
    import time

    t0 = time.perf_counter()
    path = _build_root() / f"infinigen_cpu_{_cpu_key()}"
    if is_built():
        return {"kernels": "already built", "seconds": 0.0, "path": str(path),
                "line": f"infinigen: CPU kernels already built for this machine ({path})"}
    module = library()
    seconds = round(time.perf_counter() - t0, 1)
    if module is None:
        return {"kernels": "unavailable", "seconds": seconds, "path": None,
                "line": "infinigen: CPU kernels not built (no C++ compiler or ninja): the PyTorch path serves, the "
                        "same results, slower"}
    return {"kernels": "built", "seconds": seconds, "path": str(path),
            "line": f"infinigen: CPU kernels built in {seconds:.0f} s ({path})"}


def is_built() -> bool:
    """Whether this machine's build of the current source is there (found without building it)."""
    name = f"infinigen_cpu_{_cpu_key()}"
    d = _build_root() / name
    return (d / f"{name}.so").is_file() and not (d / "lock").exists()


def _build():
    built = _prebuilt()
    if built is not None:
        return built
    try:
        from torch.utils.cpp_extension import load

        if not _built():
            print("infinigen: building the CPU kernels (once per machine) ...", file=sys.stderr, flush=True)
        return load(name=f"infinigen_cpu_{_cpu_key()}", sources=[str(p) for p in _SOURCES], extra_cflags=_FLAGS,
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, headers or ninja: the PyTorch path serves
        warnings.warn(f"infinigen: CPU kernels unavailable ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                      "using the slower PyTorch path", stacklevel=3)
        return None


def _built() -> bool:
    from torch.utils.cpp_extension import _get_build_directory

    d = Path(_get_build_directory(f"infinigen_cpu_{_cpu_key()}", verbose=False))
    return any(d.glob("*.so"))


def _build_root() -> Path:
    """torch's extension build root, as torch.utils.cpp_extension names it (TORCH_EXTENSIONS_DIR, or the user cache's
    torch_extensions/py<version>_<cpu|cu...>), found without importing that module (it imports setuptools: ~0.15 s)."""
    import torch
    import torch._appdirs

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return Path(root)
    accel = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip is not None else
             f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda is not None else "cpu")
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(os.path.realpath(torch._appdirs.user_cache_dir(appname="torch_extensions"))) / f"{py}_{accel}"


def _prebuilt():
    """The module built before for this CPU and source, imported straight from its .so; None: not built (or being
    built: its lock file is there), and torch's `load` builds or waits for it."""
    import importlib.util

    name = f"infinigen_cpu_{_cpu_key()}"
    try:
        d = _build_root() / name
        so = d / f"{name}.so"
        if not so.is_file() or (d / "lock").exists():
            return None
        spec = importlib.util.spec_from_file_location(name, so)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except Exception:  # (any surprise: torch's own load decides)
        return None
