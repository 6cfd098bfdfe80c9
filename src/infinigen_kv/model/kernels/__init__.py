"""The CPU kernels of the decode step (cpu.cpp) and of a prompt chunk's attention over a long past (prefill.cpp),
compiled for the machine by the install step (`infinigen build-kernels`: `build()`), or at first use where the
install did not.

`cpu()` returns the compiled module, or None where it cannot be built (no C++ compiler) or is switched
off with INFINIGEN_KERNELS=0 (read once, at the first call: `cpu()` runs hundreds of times a step);
callers then take the plain-PyTorch path, which computes the same thing.
The build is cached by torch under ~/.cache/torch_extensions, keyed by the CPU's instruction set (the
code is compiled for the machine it runs on), so it happens once per machine and source (~60 s on 2 cores).
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
from pathlib import Path

_SOURCES = [Path(__file__).with_name(name) for name in ("cpu.cpp", "prefill.cpp")]
_HEADERS = [Path(__file__).with_name(h) for h in ("attend512.h", "bf16_dots.h")]  # cpu.cpp includes them: in the key
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math", "-fopenmp"]
_module = None
_tried = False
_enabled = None  # INFINIGEN_KERNELS != "0", read at the first call
_silu_exact = None  # silu_mul_exact(), checked once


def _cpu_key() -> str:
    """A short hash of the CPU's feature flags, the compiler flags and the source: a build for one instruction set (or
    another source) is never loaded for another."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    text = "".join(p.read_text() for p in _SOURCES + _HEADERS)
    return hashlib.sha1((flags + " ".join(_FLAGS) + text).encode()).hexdigest()[:10]


def enabled() -> bool:
    global _enabled
    if _enabled is None:
        _enabled = os.environ.get("INFINIGEN_KERNELS", "1") != "0"
    return _enabled


def cpu():
    """The compiled kernels (speculate, attend, linear), or None."""
    global _module, _tried
    if not enabled():
        return None
    if not _tried:
        _tried = True
        _module = _build()
        if _module is not None:
            _module.set_attend_pairs_upto(attend_pairs_upto(_module))
    return _module


def attend_pairs_upto(module) -> int:
    """Up to how many query heads a KV head attend multiplies long bfloat16 K/V rows in bfloat16 pairs (vdpbf16ps,
    bf16_dots.h) rather than in float32 products of the rows widened once for all those heads (attend512.h): 0 where
    the CPU has no AVX-512 BF16. INFINIGEN_ATTEND_PAIRS_UPTO sets it; otherwise it is measured once per machine and
    build (the two alternated on a decode-shaped call at 1, 2, 4 and 8 heads; pairs where >= 5% faster) and kept beside
    the build, so that a machine's choice, and its bits, stay the same."""
    if not module.bf16_dots_native():
        return 0
    given = os.environ.get("INFINIGEN_ATTEND_PAIRS_UPTO")
    if given is not None:
        if given.strip().lstrip("-").isdigit():
            return int(given)
        warnings.warn(f"infinigen: INFINIGEN_ATTEND_PAIRS_UPTO must be a whole number of query heads, not {given!r}; "
                      "using this machine's measured choice", stacklevel=3)
    path = _build_root() / f"infinigen_cpu_{_cpu_key()}" / "attend_pairs_upto"
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        pass
    upto = _measure_attend_pairs(module)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{upto}\n")
    except OSError:
        pass
    return upto


def attend_head_ns() -> float | None:
    """Wall nanoseconds a decode step's dense attention spends per (past token, query head) at 64 channels over
    bfloat16 rows, from the caches (its arithmetic, with this machine's products and torch's threads); None without the
    kernels. Measured once per machine, build and thread count (4 x 2 rows of 4,096 tokens, 8 query heads a KV head,
    median of 9) and kept beside the build, so that what it decides (InfiniGen's dense-or-speculate rule) stays the
    same from run to run."""
    module = cpu()
    if module is None:
        return None
    import torch

    threads = torch.get_num_threads()
    if threads not in _head_ns:
        path = _build_root() / f"infinigen_cpu_{_cpu_key()}" / f"attend_head_ns_t{threads}"
        try:
            _head_ns[threads] = float(path.read_text())
        except (OSError, ValueError):
            _head_ns[threads] = _measure_head_ns(module)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(f"{_head_ns[threads]:.4f}\n")
            except OSError:
                pass
    return _head_ns[threads]


_head_ns: dict = {}


def _measure_head_ns(module) -> float:
    import time

    import torch

    B, G, r, n = 4, 2, 8, 4096
    g = torch.Generator().manual_seed(0)
    K, V = (torch.randn(B, G, n, 64, generator=g).bfloat16() for _ in range(2))
    q = torch.randn(B, G, r, 64, generator=g)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        module.attend(q, K, V, None, None, None, -1, None, n, 0.125, torch.float32)
        times.append(time.perf_counter() - t)
    return sorted(times[1:])[4] * 1e9 / (B * G * r * n)


def _measure_attend_pairs(module) -> int:
    """The most heads (of 1, 2, 4, 8) at which pairs beat widened rows by >= 5%, testing from 1 up (their edge falls
    with the heads); over 4 x 2 rows of 8,192 tokens of 64 channels, median of 11 alternations each. ~0.2 s."""
    import time

    import torch

    g = torch.Generator().manual_seed(0)
    K, V = (torch.randn(4, 2, 8192, 64, generator=g).bfloat16() for _ in range(2))
    upto = 0
    try:
        for r in (1, 2, 4, 8):
            q = torch.randn(4, 2, r, 64, generator=g)
            times = {0: [], r: []}
            for _ in range(12):
                for setting in times:
                    module.set_attend_pairs_upto(setting)
                    t = time.perf_counter()
                    module.attend(q, K, V, None, None, None, -1, None, 8192, 0.125, torch.float32)
                    times[setting].append(time.perf_counter() - t)
            widened, pairs = (sorted(times[k][1:])[5] for k in (0, r))  # (the first of each: a warm-up)
            if pairs >= 0.95 * widened:
                break
            upto = r
    finally:
        module.set_attend_pairs_upto(0)
    return upto


def silu_lanes() -> int:
    """The float32 vector width of PyTorch's CPU kernels (its CPU capability), which `silu_mul` follows to give
    F.silu's bits: 8 (AVX2), 16 (AVX-512), 0 (other: expf throughout)."""
    import torch

    return {"AVX2": 8, "AVX512": 16}.get(torch.backends.cpu.get_cpu_capability(), 0)


def silu_mul_exact() -> bool:
    """Whether the `silu_mul` kernel gives F.silu(gate) * up's bits on this machine (checked once, on values that
    take every path: vectors, the scalar tail, large and tiny magnitudes); callers use PyTorch's ops otherwise."""
    global _silu_exact
    if _silu_exact is None:
        import torch

        kern, g = cpu(), torch.Generator().manual_seed(0)
        gu = torch.randn(3, 2 * 1000 + 2 * 13, generator=g) * torch.logspace(-3, 2, 2026)  # (3, 2F), F = 1013
        F = gu.shape[1] // 2
        _silu_exact = kern is not None and torch.equal(
            kern.silu_mul(gu, silu_lanes()), torch.nn.functional.silu(gu[:, :F].contiguous()) * gu[:, F:])
    return _silu_exact


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
    module = cpu()
    seconds = round(time.perf_counter() - t0, 1)
    if module is None:
        why = "switched off (INFINIGEN_KERNELS=0)" if not enabled() else "not built (no C++ compiler or ninja)"
        return {"kernels": "unavailable", "seconds": seconds, "path": None,
                "line": f"infinigen: CPU kernels {why}: the PyTorch path serves, the same results, slower"}
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
