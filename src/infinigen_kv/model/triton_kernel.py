"""A Triton kernel with a PyTorch twin: on a GPU the kernel, tried once; where Triton is missing or the kernel does
not build here, one warning and the PyTorch ops from then on (the reference, which the tests compare the kernel
against on CPU through TRITON_INTERPRET=1). Its module is imported at the first call: PyTorch's CUDA wheels bring
Triton, a CPU install may not have it."""

from __future__ import annotations

import importlib
import warnings


class TritonKernel:
    """`module:function` (a module of infinigen_kv), run in place of a reference; `what` names it in the warning."""

    def __init__(self, target: str, what: str):
        self.target, self.what = target, what
        self.ok = True  # False once the kernel failed here: the reference from then on
        self._fn = None

    def __call__(self, reference, *args):
        if self.ok:
            try:
                if self._fn is None:
                    module, name = self.target.split(":")
                    self._fn = getattr(importlib.import_module(f"infinigen_kv.{module}"), name)
                return self._fn(*args)
            except Exception as e:  # no Triton, or one that cannot build it here: the same result in PyTorch ops
                self.ok = False
                warnings.warn(f"infinigen: the Triton {self.what} failed ({type(e).__name__}: {str(e)[:200]}); "
                              "using PyTorch ops", stacklevel=3)
        return reference(*args)
