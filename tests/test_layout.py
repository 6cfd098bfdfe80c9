"""The package's shape: the import drawing has no cycle and no arrow from the core to the server, the
benchmarks or the command line; shared code reads the traits methods declare, never probes for them or tests a
method's name; modules and functions stay small enough to read."""

import ast
from pathlib import Path

import pytest

from infinigen_kv.methods.registry import METHOD_NAMES

ROOT = Path(__file__).resolve().parents[1] / "src" / "infinigen_kv"
FRONT = ("serve", "bench", "cli", "commands")  # what may use the core, never the other way round
TRAITS = {"needs_probs", "track_recall", "limited", "takes_budget", "pool_on_host", "shares_prefill", "batches", "stats", "method"}
MAX_MODULE, MAX_FUNCTION = 440, 88  # "about 400" and "about 80" lines


def modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = (path, ast.parse(path.read_text()))
    return out


def imports(name: str, path: Path, tree: ast.Module, known) -> set[str]:
    """The package's modules `name` imports, at any depth of its code (lazy imports count)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            for alias in node.names:
                target = ".".join(base + [alias.name])
                found.add(target if target in known else ".".join(base))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("infinigen_kv"):
            found.add(node.module.removeprefix("infinigen_kv").lstrip("."))
    return {m for m in found if m in known and m != name}


def graph():
    mods = modules()
    return {name: imports(name, path, tree, mods) for name, (path, tree) in mods.items()}


def front(name: str) -> bool:
    return name.split(".")[0] in FRONT


def test_the_import_drawing_has_no_cycle():
    g = graph()
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in g[node]:
            if state.get(nxt) == "open":
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in g:
        if node not in state:
            visit(node, [node])


def test_the_core_imports_nothing_of_serve_bench_or_cli():
    g = graph()
    wrong = [(a, b) for a, deps in g.items() for b in deps if a and not front(a) and front(b)]
    assert not wrong, wrong
    assert not g[""] and not g["config"], "the package and config.py import nothing of the package at import time"
    model_up = [(a, b) for a, deps in g.items() if a.startswith("model") for b in deps
                if b.split(".")[0] in ("methods", "runtime")]
    assert not model_up, model_up
    loop_up = [(a, b) for a, deps in g.items() if a.startswith("runtime") for b in deps if b.startswith("methods")]
    assert not loop_up, loop_up  # the decode loop takes any transformers cache


def test_shared_code_reads_declared_traits_and_no_method_names():
    """Outside methods/ (where each method declares itself, and the registry): no getattr/hasattr of a trait, and
    no comparison with a method's name (a registry trait or REFERENCE says it)."""
    bad = []
    for name, (path, tree) in modules().items():
        if name.startswith("methods"):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in TRAITS):
                bad.append(f"{path.name}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
            if isinstance(node, ast.Compare):
                for side in [node.left, *node.comparators]:
                    items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                    names = [i.value for i in items if isinstance(i, ast.Constant) and i.value in METHOD_NAMES]
                    if names:
                        bad.append(f"{path.name}:{node.lineno} compares with {names}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith"
                    and node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("hf")):
                bad.append(f"{path.name}:{node.lineno} startswith({node.args[0].value!r})")
    assert not bad, bad


def test_modules_and_functions_stay_readable():
    long = []
    for name, (path, tree) in modules().items():
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE:
            long.append(f"{name}: {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION:
                    long.append(f"{name}.{node.name}: {n} lines")
    assert not long, long


def test_moved_modules_still_import_with_a_pointer():
    import importlib
    import warnings

    import infinigen_kv as ig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module("infinigen_kv.baselines")
    assert old.make_cache is ig.make_cache and "methods.registry" in str(caught[0].message)
    with pytest.raises(ModuleNotFoundError, match="methods.infinigen"):
        importlib.import_module("infinigen_kv.calibrate")
    assert callable(ig.calibrate)


PROBED = {"cache", "layer", "target", "transfer", "self", "other", "b", "buf", "selection"}  # caches and their parts


def test_no_capability_probes_and_one_backend():
    """In model/, runtime/ and methods/: no hasattr/getattr of a named attribute on a cache, a layer, a buffer, a
    transfer or a selection (each declares what it has: model/kv.StepCache, the Protocols of
    methods/infinigen/contracts.py, class traits), and the CPU kernels are looked up by model/backend.py only."""
    bad = []
    for name, (path, tree) in modules().items():
        if name.split(".")[0] not in ("model", "runtime", "methods"):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if (isinstance(f, ast.Name) and f.id in ("getattr", "hasattr") and len(node.args) > 1
                    and isinstance(node.args[1], ast.Constant)):
                owner = node.args[0]
                owner = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
                if owner in PROBED:
                    bad.append(f"{path.name}:{node.lineno} {f.id}({owner}, {node.args[1].value!r})")
            if (isinstance(f, ast.Attribute) and f.attr in ("cpu", "library") and isinstance(f.value, ast.Name)
                    and f.value.id == "kernels" and name not in ("model.backend", "model.kernels")):
                bad.append(f"{path.name}:{node.lineno} kernels.{f.attr}() outside model/backend.py")
    assert not bad, bad
