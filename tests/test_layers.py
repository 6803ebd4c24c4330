"""The package's layers point down only, and nothing imports a kvtool module inside a function
unless the line says why (``# deferred: ...``, for start-up time or a heavy optional dependency).

Layers, bottom to top: core -> kernels (and the data package texts) -> methods -> formats -> hf -> analysis / export / bench ->
cli (``kvtool.cli`` and ``kvtool.commands``) -> api (built from the commands' declarations). A module may import its own package and the layers
below; the three packages of one layer do not import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvtool"

RANK = {"core": 0, "texts": 1, "kernels": 1, "methods": 2, "formats": 3, "hf": 4, "analysis": 5, "export": 5, "bench": 5, "presses": 5, "cli": 6, "commands": 6, "api": 7}
# modules at the top of the package: what they may import
TOP = {"_version": -1, "__init__": 8, "__main__": 8}


def layer_of(module: str) -> tuple[str, int]:
    """(package, rank) of a dotted kvtool module name."""
    parts = module.split(".")
    head = parts[1] if len(parts) > 1 else "__init__"
    if head in RANK:
        return head, RANK[head]
    if head in TOP:
        return head, TOP[head]
    raise AssertionError(f"{module}: not in any layer; add its package to RANK in {__file__}")


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path, root: Path) -> list[tuple[str, int, bool, str]]:
    """(imported kvtool module, line, inside a function, source line) for every import in ``path``."""
    src = path.read_text()
    tree = ast.parse(src)
    lines = src.splitlines()
    me = module_name(path, root)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - child.level + 1]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                # ``from kvtool import texts``: the import is of the submodule
                names = [f"{mod}.{a.name}" for a in child.names] if mod == "kvtool" else [mod]
            for name in names:
                if name == "kvtool" or name.startswith("kvtool."):
                    out.append((name, child.lineno, in_function, lines[child.lineno - 1]))
            visit(child, inner)

    visit(tree, False)
    return out


def violations(root: Path) -> list[str]:
    """Every wrong-way import and undeclared function-level import under the package ``root``."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        me = module_name(path, root)
        my_pkg, my_rank = layer_of(me)
        for target, line, in_function, text in imports_of(path, root):
            if target == "kvtool":
                if my_pkg not in ("__init__", "__main__", "cli", "commands"):
                    problems.append(f"{me}:{line} imports the kvtool package itself")
                continue
            pkg, rank = layer_of(target)
            if pkg == my_pkg:
                pass
            elif rank > my_rank or (rank == my_rank and pkg != my_pkg and not (my_pkg in ("cli", "commands") and pkg in ("cli", "commands"))):
                problems.append(f"{me}:{line} imports {target} ({pkg} is not below {my_pkg})")
            if in_function and "# deferred:" not in text:
                problems.append(f"{me}:{line} imports {target} inside a function without a '# deferred:' reason")
    return problems


def test_every_import_points_down():
    assert violations(PACKAGE) == []


def test_no_cycles_between_modules():
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        me = module_name(path, PACKAGE)
        graph[me] = {t for t, _, fn, _ in imports_of(path, PACKAGE) if not fn and t != "kvtool"}
    known = set(graph)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, ()):
            # ``from kvtool.x import y`` where y is a module: the edge goes to kvtool.x.y
            for cand in (nxt,):
                if cand not in known:
                    continue
                if state.get(cand) == 1:
                    raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(cand):] + [cand]))
                if cand not in state:
                    visit(cand)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


@pytest.mark.parametrize("wrong", [
    ("kernels/_layer_probe.py", "from kvtool.formats.base import Encoded\n"),
    ("core/_layer_probe.py", "from kvtool.analysis import stats\n"),
    ("analysis/_layer_probe.py", "from kvtool.export import convert\n"),
    ("formats/_layer_probe.py", "from kvtool.hf import models\n"),
    ("methods/_layer_probe.py", "def f():\n    from kvtool.core import io\n    return io\n"),
])
def test_a_wrong_way_import_is_caught(tmp_path, wrong):
    """A copy of the package with one deliberate wrong-way (or hidden) import fails the check."""
    import shutil

    copy = tmp_path / "kvtool"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    rel, text = wrong
    (copy / rel).write_text(text)
    found = violations(copy)
    assert len(found) == 1 and "_layer_probe" in found[0], found
