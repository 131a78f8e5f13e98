"""The modules of colossal.zero import each other without a cycle (imports under
``if TYPE_CHECKING:`` count: a type checker, a doc builder or a refactoring that makes the import
real follows them). Regression: checkpoint.py <-> optimizer.py."""

import ast
import pathlib

import colossal.zero

PACKAGE = "colossal.zero"
ROOT = pathlib.Path(colossal.zero.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    return PACKAGE if path.name == "__init__.py" else f"{PACKAGE}.{path.stem}"


def _edges(path: pathlib.Path, modules: set[str]) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == PACKAGE:  # `from colossal.zero import checkpoint` names a module
                out.update(f"{PACKAGE}.{a.name}" if f"{PACKAGE}.{a.name}" in modules else PACKAGE for a in node.names)
            elif node.module in modules:
                out.add(node.module)
    return out - {_module_name(path)}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(n: str, stack: list[str]) -> list[str] | None:
        state[n] = 1
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (found := visit(m, [*stack, m])):
                return found
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n, [n])):
            return found
    return None


def test_no_import_cycle_between_modules():
    files = sorted(ROOT.glob("*.py"))
    modules = {_module_name(f) for f in files}
    graph = {_module_name(f): _edges(f, modules) for f in files if f.name != "__init__.py"}
    graph = {n: e - {PACKAGE} for n, e in graph.items()}  # the package itself re-exports everything
    assert "colossal.zero.checkpoint" in graph["colossal.zero.optimizer"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
