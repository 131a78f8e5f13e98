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
