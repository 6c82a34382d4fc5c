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


def _imported(node: ast.AST, modules: set[str], here: tuple[str, ...]) -> list[str]:
    """The package's modules an import statement in module ``here`` (its dotted parts below trainmem) names: the
    longest name that is a module of the package (trainmem.commands.estimate, else trainmem.commands)."""
    def known(parts: list[str]) -> list[str]:
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in modules:
                return [".".join(parts[:end])]
        return []

    if isinstance(node, ast.ImportFrom):
        if node.level == 0:
            if not (node.module or "").startswith("trainmem"):
                return []
            base: list[str] = []
            parts = (node.module or "").split(".")[1:]
        else:
            package = list(here[:-1]) if not _is_package(here, modules) else list(here)
            base = package[:len(package) - (node.level - 1)]
            parts = (node.module or "").split(".") if node.module else []
        if parts:
            return known(base + parts)
        return [m for a in node.names for m in known(base + [a.name])]  # from . import x
    if isinstance(node, ast.Import):
        return [m for a in node.names if a.name.startswith("trainmem.") for m in known(a.name.split(".")[1:])]
    return []


def _is_package(here: tuple[str, ...], modules: set[str]) -> bool:
    return any(m.startswith(".".join(here) + ".") for m in modules)


def import_graph(package: Path) -> dict[str, dict[str, int]]:
    """module -> {imported module: first line}, over the package's modules and its subpackages' (a subpackage's
    __init__.py is the subpackage: trainmem.commands; its modules are trainmem.commands.estimate and so on)."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        if all((package.joinpath(*parts[:i]) / "__init__.py").exists() for i in range(1, len(parts))):
            names[path] = parts[:-1] if parts[-1] == "__init__" else parts
    modules = {".".join(parts) for parts in names.values()}
    graph: dict[str, dict[str, int]] = {}
    for path, here in names.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _type_checking(node)
                   for child in node.body for n in ast.walk(child)}
        name = ".".join(here) or "__init__"
        edges = graph.setdefault(name, {})
        for node in ast.walk(tree):
            if id(node) not in skipped:
                for target in _imported(node, modules, here):
                    if target != name:
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
    assert graph["commands.estimate"].keys() >= {"cli", "planner", "report"}  # (and the subpackages')
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
