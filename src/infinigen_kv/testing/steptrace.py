"""A decode step's ops as data (a TorchDispatchMode under the step): each op's name, its tensors' shapes and dtypes,
its other arguments, and, for tensors not made inside the step, their data pointers. What a CUDA graph needs of a
step is then checkable on CPU: two consecutive steps give the same records (the same ops on the same buffers), the
step reads nothing back to the host (`.item()`, `.tolist()`, `bool(t)`: aten._local_scalar_dense), and how many ops
each speculated layer runs."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HOST_READS = {"aten::_local_scalar_dense"}  # .item(), bool(t), int(t)
UNDISPATCHED = ("tolist", "numpy")  # host reads of a CPU tensor that bypass the dispatcher: wrapped while tracing


class StepTrace(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []  # (name, args) per op, in order
        self.kernels = 0  # ops that compute (not views, not an input handed back: those launch nothing)
        self.host_reads: list[str] = []
        self.made: set[int] = set()  # data pointers of tensors the step made
        self.marks: list[tuple[int, int]] = []  # (ops, kernels) at each mark()
        self.kernel_names: list[str | None] = []  # per op: its name where it runs a kernel

    def __enter__(self):
        self._saved = {name: getattr(torch.Tensor, name) for name in UNDISPATCHED}
        for name, method in self._saved.items():
            def read(t, *a, _name=name, _method=method, **k):
                self.host_reads.append(f"Tensor.{_name}")
                return _method(t, *a, **k)
            setattr(torch.Tensor, name, read)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    def mark(self) -> None:
        self.marks.append((len(self.ops), self.kernels))

    def _arg(self, a):
        if isinstance(a, torch.Tensor):
            ptr = a.untyped_storage().data_ptr() if a.device.type != "meta" else 0
            where = "step" if ptr in self.made else ptr
            return ("T", tuple(a.shape), str(a.dtype), a.device.type, where)
        if isinstance(a, (int, float, bool, str, type(None), torch.dtype, torch.device)):
            return a
        return type(a).__name__

    @staticmethod
    def _returns_input(flat, outs) -> bool:
        """An op that hands back one of its inputs untouched (`.to` of a tensor already so, `.contiguous()` of a
        contiguous one): no kernel. (In-place and out= ops, which return an input too and do run one, are not
        asked.)"""
        if not outs:
            return False
        ins = {a.untyped_storage().data_ptr() for a in flat if isinstance(a, torch.Tensor) and a.device.type != "meta"}
        return all(t.device.type != "meta" and t.untyped_storage().data_ptr() in ins for t in outs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name if hasattr(func, "_schema") else str(func)
        flat, _ = tree_flatten((args, kwargs))
        record = (name, tuple(self._arg(a) for a in flat))
        out = func(*args, **kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if name in HOST_READS or (any(t.device.type == "cpu" for t in outs) and any(
                isinstance(a, torch.Tensor) and a.device.type not in ("cpu", "meta") for a in flat)):
            self.host_reads.append(name)  # a scalar read, or a device tensor copied to the host
        for t in outs:
            if t.device.type != "meta":
                self.made.add(t.untyped_storage().data_ptr())
        self.ops.append(record)
        kernel = not (func.is_view or (not func._schema.is_mutable and self._returns_input(flat, outs)))
        self.kernels += kernel
        self.kernel_names.append(name if kernel else None)
        return out


def trace(fn, *args, **kwargs) -> tuple[StepTrace, object]:
    """Run fn under a StepTrace: (the trace, fn's result)."""
    with StepTrace() as t:
        out = fn(*args, **kwargs)
    return t, out


def first_difference(a: StepTrace, b: StepTrace) -> str | None:
    """Where two steps' records part (None: identical)."""
    for i, (x, y) in enumerate(zip(a.ops, b.ops)):
        if x != y:
            return f"op {i}: {x} != {y}"
    if len(a.ops) != len(b.ops):
        return f"{len(a.ops)} ops != {len(b.ops)} ops"
    return None


def held(*roots) -> set:
    """The storages (data pointer, bytes) of every tensor reachable from roots through attributes, slots, dicts,
    lists and tuples (modules, classes and functions not followed): the memory a decode step's owners keep. Equal
    before and after a step: the step allocated nothing that outlives it (what a CUDA graph's replays need)."""
    seen, out, stack = set(), set(), list(roots)
    while stack:
        x = stack.pop()
        if id(x) in seen or isinstance(x, (torch.nn.Module, type)) or callable(x) and not hasattr(x, "__dict__"):
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            if x.device.type != "meta":
                out.add((x.untyped_storage().data_ptr(), x.untyped_storage().nbytes()))
            continue
        if isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            stack.extend(x)
        else:
            stack.extend(getattr(x, "__dict__", {}).values())
            stack.extend(getattr(x, s) for s in getattr(type(x), "__slots__", ()) if hasattr(x, s))
    return out


# A method's decode steps traced (scripts/dev/step_trace.py, the GPU check's `trace` step)


def traced(cache, fn):
    """(a StepTrace of fn(), its result), marked at each layer's before_attention (the layers' boundaries)."""
    t, before = StepTrace(), cache.before_attention
    cache.before_attention = lambda *a: (t.mark(), before(*a))[1]
    try:
        with t:
            out = fn()
    finally:
        del cache.before_attention
    return t, out


def summary(a, b) -> dict:
    """Two consecutive steps' traces: kernels a step and per layer, host reads, where they part (None: nowhere)."""
    per_layer = [y[1] - x[1] for x, y in zip(a.marks, a.marks[1:])]
    return {"ops": a.kernels, "per_layer": per_layer, "host_reads": len(a.host_reads), "same": first_difference(a, b)}


def _cache(model, method: str, budget: float, ids):
    import infinigen_kv as ig
    from infinigen_kv.methods.registry import method as spec

    cache = ig.make_cache(method, model, budget=budget, min_budget=0)  # (the options a method does not take dropped)
    if ids.device.type == "cpu" and spec(method).pool_on_host:
        from . import on_fake_cuda

        on_fake_cuda(cache)  # the GPU's transfer (CudaTransfer on CPU stand-ins): the ops a GPU step runs
    return cache


def run(model, method: str, ids, budget: float) -> dict:
    """Trace the 3rd and 4th decode steps of `method` after a prefill of ids (B, n) (summary)."""
    from infinigen_kv.runtime.generation import prefill

    cache = _cache(model, method, budget, ids)
    B, n = ids.shape
    tok = prefill(model, ids, None, cache, 8).argmax(-1)  # the step's inputs in buffers of their own, refilled
    pos = torch.full((B, 1), n, device=ids.device)  # in place (as a graph replays them)
    traces = []
    for i in range(4):  # two warm-up steps, two traced
        pos.fill_(n + i)
        t, logits = traced(cache, lambda: model.decode(cache, tok, pos, None))
        tok.copy_(logits.argmax(-1))
        traces.append(t)
    return summary(*traces[2:])


def run_static(model, method: str, ids, budget: float) -> dict:
    """The same, through static steps (model/static.py: what a CUDA graph replays)."""
    from infinigen_kv.model.static import StaticDecoder
    from infinigen_kv.runtime.generation import prefill

    cache = _cache(model, method, budget, ids)
    B, n = ids.shape
    tok = prefill(model, ids, None, cache, 8).argmax(-1)
    dec = StaticDecoder(model, cache, None, torch.full((B, 1), n, device=ids.device))
    traces = []
    for _ in range(4):
        dec.refill(tok)
        t, logits = traced(cache, dec.forward)
        dec.advance()
        tok = logits.argmax(-1)
        traces.append(t)
    return summary(*traces[2:])
