"""The package's layout holds: each package imports only those below it in the flow (recon's
sub-packages too), no module imports itself back through others (type-only and function-level imports
count), no module is over 400 lines and no function over 60, and what recon.units answers loads
without Lightning. Read from the source, so a change that breaks the layering fails here."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from finetune import LAYERS

ROOT = Path(__file__).parent.parent / "finetune"
RANK = {package: rank for rank, packages in enumerate(LAYERS) for package in packages}
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 60


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its __init__)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path) -> set[str]:
    """The finetune modules a module imports, wherever the import statement stands."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module or ""
            found.update(f"{base}.{alias.name}" for alias in node.names)
            if node.module:  # `from . import x` imports the submodule x alone
                found.add(base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {module for module in found if module.startswith("finetune.")}


def layer_of(module: str) -> str:
    """The layer name a module belongs to (the most specific entry of LAYERS)."""
    parts = module.split(".")[1:]
    for depth in (2, 1):
        if ".".join(parts[:depth]) in RANK:
            return ".".join(parts[:depth])
    raise KeyError(f"{module} belongs to no layer of LAYERS: add its package there")


def graph() -> dict[str, set[str]]:
    """Each module's imports of other modules (an import of a name from a package is of the package)."""
    known = modules()
    return {name: {module for module in imports(name, path) if module in known and module != name}
            for name, path in known.items()}


def test_every_package_imports_only_those_below_it() -> None:
    upward = [f"{name} imports {module}" for name, targets in graph().items() for module in targets
              if RANK[layer_of(module)] > RANK[layer_of(name)]]
    assert not upward


def test_no_module_imports_itself_back() -> None:
    edges = graph()
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in edges[module]:
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(edges)))
    for module in edges:
        if module not in order:
            visit(module)
    assert not cycles


def test_modules_and_functions_stay_short() -> None:
    long = defaultdict(list)
    for name, path in modules().items():
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            long["modules"].append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                long["functions"].append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long


@pytest.mark.parametrize(("module", "absent"), [("finetune.recon.units", "lightning"), ("finetune.recon", "lightning"),
                                                ("finetune.automp.resume", "lightning")])
def test_what_does_not_need_lightning_loads_without_it(module: str, absent: str) -> None:
    """Lightning takes seconds to import: the units of a model, the recon package's names and the
    mixed-precision search's graph work (lift.graph) do not load it."""
    code = f"import sys, {module}; sys.exit({absent!r} in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
