"""A Triton kernel with a PyTorch twin: on a GPU the kernel where Triton is installed (PyTorch's CUDA wheels bring
it), the PyTorch ops where it is not (the reference, which the tests compare the kernel against on CPU through
TRITON_INTERPRET=1). Which one runs is a fact of the install, the same at every call: a kernel that fails raises
(naming itself), rather than switching the process to other arithmetic from then on."""

from __future__ import annotations

import functools
import importlib
import importlib.util


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


class TritonError(RuntimeError):
    """A Triton kernel that cannot load or run here."""


class TritonKernel:
    """`module:function` (a module of infinigen_kv), run in place of a reference; `what` names it in errors;
    installed: whether Triton is there (None: look)."""

    def __init__(self, target: str, what: str, installed: bool | None = None):
        self.target, self.what, self.installed = target, what, installed
        self._fn = None

    def function(self):
        """The kernel's function, imported once (its module imports Triton)."""
        if self._fn is None:
            module, name = self.target.split(":")
            try:
                self._fn = getattr(importlib.import_module(f"infinigen_kv.{module}"), name)
            except (ImportError, AttributeError) as e:
                raise TritonError(f"infinigen: the Triton {self.what} cannot be loaded ({type(e).__name__}: "
                                  f"{str(e)[:200]})") from e
        return self._fn

    def __call__(self, reference, *args):
        if not (self.installed if self.installed is not None else triton_installed()):
            return reference(*args)
        fn = self.function()
        try:
            return fn(*args)
        except TritonError:
            raise
        except Exception as e:  # a kernel Triton cannot build or run here: said, not hidden
            raise TritonError(f"infinigen: the Triton {self.what} failed ({type(e).__name__}: {str(e)[:200]})") from e
