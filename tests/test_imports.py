"""The package's import graph has no cycle, and the estimate imports no heavy library.

Every import of a trainmem module counts, at module level or inside a function (a deferred import is still a
dependency: it only moves the failure to run time), except those under ``if TYPE_CHECKING:``, which never run."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "trainmem"


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return isinstance(t, ast.Name) and t.id == "TYPE_CHECKING" or isinstance(t, ast.Attribute) and \
        t.attr == "TYPE_CHECKING"


def _imported(node: ast.AST, modules: set[str]) -> list[str]:
    """The package's modules an import statement names."""
    if isinstance(node, ast.ImportFrom):
        if node.level == 0 and not (node.module or "").startswith("trainmem"):
            return []
        parts = (node.module or "").split(".")[1 if node.level == 0 else 0:]
        if parts and parts[0]:
            return [parts[0]] if parts[0] in modules else []
        return [a.name for a in node.names if a.name in modules]  # from . import x
    if isinstance(node, ast.Import):
        return [a.name.split(".")[1] for a in node.names
                if a.name.startswith("trainmem.") and a.name.split(".")[1] in modules]
    return []


def import_graph(package: Path) -> dict[str, dict[str, int]]:
    """module -> {imported module: first line}, over the package's top-level modules."""
    modules = {p.stem for p in package.glob("*.py")} | {p.parent.name for p in package.glob("*/__init__.py")}
    graph: dict[str, dict[str, int]] = {}
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _type_checking(node)
                   for child in node.body for n in ast.walk(child)}
        edges = graph.setdefault(path.stem, {})
        for node in ast.walk(tree):
            if id(node) not in skipped:
                for target in _imported(node, modules):
                    if target != path.stem:
                        edges.setdefault(target, node.lineno)
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle (a list of modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in graph.get(m, {}):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_package_import_graph_is_acyclic():
    graph = import_graph(PACKAGE)
    assert graph["stepmodel"].keys() >= {"estimate", "timeline"}  # (the graph is read: no vacuous pass)
    cycle = find_cycle(graph)
    where = cycle and " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:]))
    assert cycle is None, f"import cycle: {where} -> {cycle[-1]}"


def test_a_deferred_import_cycle_is_found(tmp_path):
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from .c import y\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import f\n"
                                   "def g():\n    from . import a\n")
    assert find_cycle(import_graph(tmp_path)) == ["a", "b", "c", "a"]
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n")
    assert find_cycle(import_graph(tmp_path)) is None  # type-only imports do not run


HEAVY = ("torch", "transformers", "rich", "pydantic", "fastapi", "huggingface_hub", "jsonschema", "numpy",
         "matplotlib", "peft", "deepspeed", "accelerate")


def test_estimate_on_a_pipe_imports_no_heavy_library():
    """`trainmem estimate` to a pipe or a file: the core and click only (rich draws terminals; plaintext.py the
    rest)."""
    code = ("import sys, io; import trainmem.cli as c; sys.stdout = io.StringIO(); code = c.main(['estimate', "
            "'llama-2-7b']); out = sys.stdout.getvalue(); sys.stdout = sys.__stdout__; "
            f"print(code, 'allocated' in out, sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip().split(maxsplit=2) == ["0", "True", "[]"]
