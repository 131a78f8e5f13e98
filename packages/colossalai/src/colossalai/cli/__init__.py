"""The ``colossalai`` command line: ``train`` (the main job), ``run`` (launcher), ``check``."""

from colossalai.cli.main import build_parser, main

__all__ = ["main", "build_parser"]
