"""``colossalai check`` warns in one line when the imported ``colossalai`` is not this project's
(the public index's ``colossalai`` is HPC-AI Tech's Colossal-AI)."""

import importlib.metadata
import types

import colossalai
from colossalai.cli import check


def _owners(monkeypatch, *dists):
    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: {"colossalai": list(dists)})


def test_ours_gives_no_warning(monkeypatch):
    _owners(monkeypatch, "colossal-stack")
    assert colossalai.__distribution__ == check.DISTRIBUTION == "colossal-stack"
    assert check.foreign_colossalai() is None


def test_another_distribution_of_colossalai_is_named(monkeypatch):
    _owners(monkeypatch, "colossal-stack", "colossalai")
    warning = check.foreign_colossalai()
    assert warning.startswith("WARNING: the imported colossalai") and "\n" not in warning
    assert "is not colossal-stack (distribution colossalai)" in warning


def test_a_module_without_our_marker_is_foreign(monkeypatch):
    _owners(monkeypatch)
    fake = types.ModuleType("colossalai")
    fake.__file__ = "/site-packages/colossalai/__init__.py"
    monkeypatch.setattr(check.importlib, "import_module", lambda name: fake)
    warning = check.foreign_colossalai()
    assert "/site-packages/colossalai/__init__.py" in warning and "no colossal-stack marker" in warning


def test_check_lists_every_package_the_meta_package_depends_on():
    """#31 item 8: ``check`` left out colossal-moe and colossal-pipeline; its list now equals the
    meta-package's own ``colossal-*`` requirements (pyproject.toml), so it cannot drift again."""
    import pathlib
    import re
    import tomllib

    pyproject = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["name"] == check.DISTRIBUTION
    wanted = {re.match(r"[A-Za-z0-9_.-]+", d)[0] for d in pyproject["project"]["dependencies"]}
    wanted = {d for d in wanted if d.startswith("colossal-")} | {check.DISTRIBUTION}
    assert set(check.COMPONENTS) == wanted
    rows = {name: status for name, _, status in check._component_rows()}
    assert rows["colossal-moe"] == rows["colossal-pipeline"] == "ok", rows
