"""Every Triton kernel compiles for a Hopper GPU (sm_90) here, without one: Triton's compiler runs on CPU down to the
cubin. The interpreter the other kernel tests use runs the kernels as Python and lets through what the compiler
refuses (a plain global in a jitted function, a type a GPU op does not take): this catches those before a GPU run.
The compiles run in a child process: the tests' TRITON_INTERPRET, read when triton is imported, must be unset."""

import os
import subprocess
import sys

import pytest
import torch

TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int8: "i8", torch.uint8: "u8",
         torch.int32: "i32", torch.int64: "i64"}


class Launches:
    """Stands for a jitted function: records each launch's arguments instead of running it."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        return lambda *args, **constexprs: self.calls.append((args, constexprs))


def compile_for_hopper(fn, args, constexprs):
    """triton.compile of fn with its arguments' types (tensors as pointers) and constexprs, for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget

    names = fn.arg_names
    sig, const = {}, {}
    for name, a in zip(names, args):
        if isinstance(a, torch.Tensor):
            sig[name] = "*" + TYPES[a.dtype]
        else:
            sig[name] = "fp32" if isinstance(a, float) else "i1" if isinstance(a, bool) else "i32"
    for name, value in constexprs.items():
        sig[name] = "constexpr"
        const[(names.index(name),)] = value
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=const)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32))


def launches(module, kernel: str, run) -> list:
    """The launches `run()` makes of module.kernel, recorded (nothing runs)."""
    fn = getattr(module, kernel)
    rec = Launches(fn)
    setattr(module, kernel, rec)
    try:
        run()
    finally:
        setattr(module, kernel, fn)
    assert rec.calls
    return [(fn, *call) for call in rec.calls]


def store_launches(pool):
    from infinigen_kv.methods.infinigen import store_row_triton as m

    B, G, d, p = 2, 8, 128, 32
    w = d + 2 * (d // 32) if pool == torch.int8 else d
    k, v = (torch.randn(B, G, 1, d, dtype=torch.bfloat16) for _ in range(2))
    pools = [torch.zeros(B, G, 64, w, dtype=pool) for _ in range(2)]
    ws = [torch.zeros(B, G, 9, w, dtype=pool) for _ in range(2)]
    part, ch = torch.zeros(B, G, 64, p, dtype=torch.bfloat16), torch.zeros(G, p, dtype=torch.int64)
    return launches(m, "_store_row", lambda: m.triton_store(k, v, *pools, torch.tensor([3]), *ws, part, ch))


def gather_launches(pool):
    from infinigen_kv.methods.infinigen import gather_rows_triton as m

    B, G, w, n = 2, 8, 128, 16
    pools = [torch.zeros(B, G, 64, w, dtype=pool) for _ in range(2)]
    ws = [torch.zeros(B, G, n + 1, w, dtype=pool) for _ in range(2)]
    return launches(m, "_gather", lambda: m.triton_gather(*pools, torch.zeros(B, G, n, dtype=torch.int64), *ws))


def scores_launches(bias: bool):
    from infinigen_kv.methods.infinigen import partial_scores_triton as m

    B, G, r, p, n = 2, 8, 4, 32, 100
    q, keys = torch.randn(B, G, r, p), torch.zeros(B, G, n, p, dtype=torch.bfloat16)
    add = torch.zeros(B, G, 1, n) if bias else None
    return launches(m, "_scores", lambda: m.triton_scores(q, keys, add, 0.125))


CASES = {"store bf16": lambda: store_launches(torch.bfloat16), "store int8 rows": lambda: store_launches(torch.int8),
         "gather bf16": lambda: gather_launches(torch.bfloat16), "gather int8 rows": lambda: gather_launches(torch.int8),
         "scores": lambda: scores_launches(False), "scores with a bias": lambda: scores_launches(True)}


def test_every_triton_kernel_compiles_for_hopper():
    pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.split() == ["ok"] * len(CASES)


if __name__ == "__main__":  # the child: each case's launches compiled to a cubin
    for case, make in CASES.items():
        for call in make():
            assert "cubin" in compile_for_hopper(*call).asm, case
        print("ok", flush=True)
