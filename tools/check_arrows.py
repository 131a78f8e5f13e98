"""Fail when a package imports a sibling it does not declare, or one ARCHITECTURE.md forbids.

Five rules, checked statically over every ``packages/*/src`` file (tests and benches may use the
``test``/bench extras, so only ``src`` is checked):

1. a sibling import must be declared in ``[project].dependencies``;
2. a declared sibling must be one of the arrows allowed in ``ARCHITECTURE.md`` (``ALLOWED``);
3. a sibling is reached only through its public names: ``colossal.comm`` but never
   ``colossal.comm._private``;
4. a test-only package (``TEST_ONLY``: colossal-testkit) is never a run-time dependency and never
   imported by any ``src``; packages list it in their ``test`` extra;
5. no import circle between the modules of one package (top-level, lazy or ``TYPE_CHECKING``).

Run as ``python tools/check_arrows.py`` (the ``lint`` nox session does); exits 1 with one line per
violation.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "packages"
ALL = {
    "colossal-comm",
    "colossal-optim",
    "colossal-zero",
    "colossal-gemini",
    "colossal-tensor-parallel",
    "colossal-moe",
    "colossal-pipeline",
    "colossal-profiler",
    "colossal-planner",
    "colossal-fastfold",
}
ALLOWED: dict[str, set[str]] = {
    "colossal-comm": set(),
    "colossal-optim": set(),
    "colossal-zero": {"colossal-comm", "colossal-optim"},
    "colossal-gemini": {"colossal-comm", "colossal-optim"},
    "colossal-tensor-parallel": {"colossal-comm"},
    "colossal-moe": {"colossal-comm"},
    "colossal-pipeline": {"colossal-comm"},
    "colossal-profiler": set(),
    "colossal-planner": {"colossal-comm"},
    "colossal-fastfold": {"colossal-comm"},
    "colossal-stack": ALL,
    "colossal-testkit": set(),
}
TEST_ONLY = {"colossal-testkit"}
"""Packages that only test suites (and benches) use: declared in ``test`` extras, never in
``dependencies``, never imported from ``src``."""


def import_roots(root: pathlib.Path = ROOT) -> dict[str, str]:
    """Map each importable top-level module (``colossal.comm``, ``fastfold``) to its distribution."""
    owners = {}
    for pyproject in root.glob("*/pyproject.toml"):
        dist = tomllib.loads(pyproject.read_text())["project"]["name"]
        for top in (pyproject.parent / "src").iterdir():
            if top.name == "colossal":
                owners.update({f"colossal.{sub.name}": dist for sub in top.iterdir() if sub.is_dir()})
            elif top.is_dir() and not top.name.endswith(".egg-info"):
                owners[top.name] = dist
    return owners


def imported_names(path: pathlib.Path) -> list[tuple[int, str]]:
    """Every absolute module name imported by a file, with its line number."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append((node.lineno, node.module))
            names += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if node.module == "colossal"]
    return names


def violations(root: pathlib.Path = ROOT) -> list[str]:
    """All rule violations under ``root`` as human-readable lines."""
    owners = import_roots(root)
    bad = []
    for pyproject in sorted(root.glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        dist = project["name"]
        declared = {re.split(r"[ <>=!~;\[]", d, maxsplit=1)[0].lower() for d in project.get("dependencies", [])}
        for sib in sorted(declared & TEST_ONLY):
            bad.append(f"{pyproject}: declares test-only {sib} in dependencies (list it in the test extra)")
        for sib in sorted((declared & set(owners.values())) - ALLOWED.get(dist, set()) - TEST_ONLY):
            bad.append(f"{pyproject}: declares {sib}, an arrow ARCHITECTURE.md does not allow")
        for path in sorted((pyproject.parent / "src").rglob("*.py")):
            for lineno, name in imported_names(path):
                for mod, owner in owners.items():
                    if owner == dist or not (name == mod or name.startswith(mod + ".")):
                        continue
                    if owner in TEST_ONLY:
                        bad.append(f"{path}:{lineno}: imports {name} of test-only {owner}; only tests may")
                        continue
                    if owner not in declared:
                        bad.append(f"{path}:{lineno}: imports {name} ({owner}) but {dist} does not declare it")
                    rest = name[len(mod) + 1 :]
                    if any(part.startswith("_") for part in rest.split(".") if part):
                        bad.append(f"{path}:{lineno}: imports private {name} of {owner}")
    return bad


def _module_files(src: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for the modules (not the package ``__init__``) under ``src``."""
    mods = {}
    for path in sorted(src.rglob("*.py")):
        if path.name != "__init__.py" and ".egg-info" not in str(path):
            mods[".".join(path.relative_to(src).with_suffix("").parts)] = path
    return mods


def _module_imports(path: pathlib.Path) -> set[str]:
    """Every absolute name a file imports, anywhere (top level, in functions, under
    ``TYPE_CHECKING``), with ``from a import b`` giving both ``a`` and ``a.b``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def import_cycles(root: pathlib.Path = ROOT) -> list[list[str]]:
    """Circles of imports between the modules of one package (``a`` imports ``b`` imports ...
    ``a``), however the imports are made; the package ``__init__`` modules are left out (every
    module reaches them). Each circle is listed once, as its modules in sorted order."""
    cycles = []
    for pyproject in sorted(root.glob("*/pyproject.toml")):
        mods = _module_files(pyproject.parent / "src")
        graph = {m: sorted(n for n in _module_imports(p) if n in mods and n != m) for m, p in mods.items()}
        cycles += [sorted(c) for c in _strongly_connected(graph) if len(c) > 1]
    return cycles


def _strongly_connected(graph: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` (node -> successors)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            out.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def main() -> int:
    bad = violations()
    for line in bad:
        print(line)
    print(f"import arrows: {len(bad)} violation(s)")
    cycles = import_cycles()
    for cycle in cycles:
        print("import circle: " + " <-> ".join(cycle))
    return 1 if bad or cycles else 0


if __name__ == "__main__":
    sys.exit(main())
