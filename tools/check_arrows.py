"""Fail when a package imports a sibling it does not declare, or one ARCHITECTURE.md forbids.

Three rules, checked statically over every ``packages/*/src`` file (tests and benches may use the
``test``/bench extras, so only ``src`` is checked):

1. a sibling import must be declared in ``[project].dependencies``;
2. a declared sibling must be one of the arrows allowed in ``ARCHITECTURE.md`` (``ALLOWED``);
3. a sibling is reached only through its public names: ``colossal.comm`` but never
   ``colossal.comm._private``.

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
    "colossal-pipeline",
    "colossal-profiler",
    "fastfold",
}
ALLOWED: dict[str, set[str]] = {
    "colossal-comm": set(),
    "colossal-optim": set(),
    "colossal-zero": {"colossal-comm", "colossal-optim"},
    "colossal-gemini": {"colossal-comm", "colossal-optim"},
    "colossal-tensor-parallel": {"colossal-comm"},
    "colossal-pipeline": {"colossal-comm"},
    "colossal-profiler": set(),
    "fastfold": {"colossal-comm"},
    "colossalai": ALL,
}


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
        for sib in sorted((declared & set(owners.values())) - ALLOWED.get(dist, set())):
            bad.append(f"{pyproject}: declares {sib}, an arrow ARCHITECTURE.md does not allow")
        for path in sorted((pyproject.parent / "src").rglob("*.py")):
            for lineno, name in imported_names(path):
                for mod, owner in owners.items():
                    if owner == dist or not (name == mod or name.startswith(mod + ".")):
                        continue
                    if owner not in declared:
                        bad.append(f"{path}:{lineno}: imports {name} ({owner}) but {dist} does not declare it")
                    rest = name[len(mod) + 1 :]
                    if any(part.startswith("_") for part in rest.split(".") if part):
                        bad.append(f"{path}:{lineno}: imports private {name} of {owner}")
    return bad


def main() -> int:
    bad = violations()
    for line in bad:
        print(line)
    print(f"import arrows: {len(bad)} violation(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
