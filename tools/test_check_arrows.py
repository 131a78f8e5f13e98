"""The import-arrow checker finds undeclared, forbidden and private sibling imports."""

import pathlib

import check_arrows


def _package(root: pathlib.Path, dist: str, module: str, deps: list[str], code: str) -> None:
    d = root / dist
    src = d / "src" / pathlib.Path(*module.split("."))
    src.mkdir(parents=True)
    (src / "__init__.py").write_text(code)
    dep_list = ", ".join(f'"{x}"' for x in deps)
    (d / "pyproject.toml").write_text(f'[project]\nname = "{dist}"\ndependencies = [{dep_list}]\n')


def test_clean_tree_passes(tmp_path):
    _package(tmp_path, "colossal-comm", "colossal.comm", ["torch"], "import torch\n")
    _package(
        tmp_path, "colossal-zero", "colossal.zero", ["colossal-comm>=0.1"], "from colossal.comm import all_reduce\n"
    )
    assert check_arrows.violations(tmp_path) == []


def test_undeclared_forbidden_and_private_imports_are_reported(tmp_path):
    _package(tmp_path, "colossal-comm", "colossal.comm", [], "")
    _package(tmp_path, "colossal-optim", "colossal.optim", ["colossal-comm"], "from colossal.comm._x import y\n")
    _package(tmp_path, "colossal-profiler", "colossal.profiler", [], "import colossal.optim\n")
    bad = "\n".join(check_arrows.violations(tmp_path))
    assert "declares colossal-comm, an arrow ARCHITECTURE.md does not allow" in bad
    assert "imports private colossal.comm._x of colossal-comm" in bad
    assert "imports colossal.optim (colossal-optim) but colossal-profiler does not declare it" in bad


def test_test_only_package_stays_out_of_src(tmp_path):
    _package(tmp_path, "colossal-testkit", "colossal.testkit", ["torch"], "")
    _package(tmp_path, "colossal-zero", "colossal.zero", ["colossal-testkit"], "from colossal.testkit import GPT\n")
    _package(tmp_path, "colossal-comm", "colossal.comm", [], "import colossal.testkit.gpt\n")
    bad = check_arrows.violations(tmp_path)
    assert len(bad) == 3, bad
    text = "\n".join(bad)
    assert "declares test-only colossal-testkit in dependencies (list it in the test extra)" in text
    assert "imports colossal.testkit of test-only colossal-testkit; only tests may" in text
    assert "imports colossal.testkit.gpt of test-only colossal-testkit; only tests may" in text


def test_import_circles_are_found_however_imported(tmp_path):
    _package(tmp_path, "colossal-comm", "colossal.comm", [], "from colossal.comm.a import x\n")
    src = tmp_path / "colossal-comm" / "src" / "colossal" / "comm"
    (src / "a.py").write_text("def f():\n    from colossal.comm import b\n")  # lazy, by attribute
    (src / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import colossal.comm.a\n")
    (src / "c.py").write_text("from colossal.comm.a import f\n")  # one way only: no circle
    assert check_arrows.import_cycles(tmp_path) == [["colossal.comm.a", "colossal.comm.b"]]
    (src / "b.py").write_text("")
    assert check_arrows.import_cycles(tmp_path) == []


def test_no_package_has_an_import_circle():
    """issue 17: colossal.comm.mesh <-> colossal.comm.layouts and colossal.zero.checkpoint <->
    colossal.zero.optimizer were circles; none may come back."""
    assert check_arrows.import_cycles() == []


def test_the_repository_itself_is_clean():
    assert check_arrows.violations() == []
