"""The package imports and carries a version."""

import importlib.metadata


def test_import_and_version():
    import colossalai  # noqa: F401

    assert importlib.metadata.version("colossal-stack")
