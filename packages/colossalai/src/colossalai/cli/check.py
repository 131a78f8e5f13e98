"""``colossalai check``: installed components and versions, torch, devices, backends, and a
two-process gloo smoke test."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import re

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

__all__ = ["check", "COMPONENTS", "DISTRIBUTION", "foreign_colossalai"]

DISTRIBUTION = "colossal-stack"
"""This project's distribution of ``import colossalai`` (the index's ``colossalai`` is another one)."""

COMPONENTS = {
    DISTRIBUTION: "colossalai",
    "colossal-comm": "colossal.comm",
    "colossal-optim": "colossal.optim",
    "colossal-zero": "colossal.zero",
    "colossal-gemini": "colossal.gemini",
    "colossal-tensor-parallel": "colossal.tensor_parallel",
    "colossal-moe": "colossal.moe",
    "colossal-pipeline": "colossal.pipeline",
    "colossal-profiler": "colossal.profiler",
    "colossal-planner": "colossal.planner",
    "colossal-fastfold": "fastfold",
}
"""Distribution name -> import name of every Colossal package (the meta-package and each ``colossal-*``
distribution it depends on; a test keeps the two lists equal)."""


def _component_rows() -> list[tuple[str, str, str]]:
    rows = []
    for dist_name, module in COMPONENTS.items():
        try:
            version = importlib.metadata.version(dist_name)
            importlib.import_module(module)
            status = "ok"
        except importlib.metadata.PackageNotFoundError:
            version, status = "-", "not installed"
        except Exception as exc:  # noqa: BLE001 - report any import failure
            version, status = version, f"import failed: {type(exc).__name__}: {exc}"
        rows.append((dist_name, version, status))
    return rows


def foreign_colossalai() -> str | None:
    """One warning line when the ``colossalai`` that Python imports is not this project's (for example
    ``pip install colossalai`` put HPC-AI Tech's Colossal-AI over it), else None.

    Two signs: the imported module lacks this project's marker (``colossalai.__distribution__``), or
    another installed distribution also provides the top-level ``colossalai``.
    """
    module = importlib.import_module("colossalai")
    marker = getattr(module, "__distribution__", None)
    owners = importlib.metadata.packages_distributions().get("colossalai", [])
    others = sorted({o for o in owners if re.sub(r"[-_.]+", "-", o).lower() != DISTRIBUTION})
    if marker == DISTRIBUTION and not others:
        return None
    found = f"distribution {', '.join(others)}" if others else f"no {DISTRIBUTION} marker"
    return (
        f"WARNING: the imported colossalai ({getattr(module, '__file__', '?')}) is not {DISTRIBUTION} "
        f"({found}); `pip uninstall colossalai` and install this project (docs/install.md)"
    )


def _smoke_rank() -> float:
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return t.item()


def smoke_test(world_size: int = 2) -> bool:
    """All-reduce on ``world_size`` gloo processes; True when every rank sees the right sum."""
    from colossal.comm.testing import run_distributed

    expected = world_size * (world_size + 1) / 2
    return all(v == expected for v in run_distributed(_smoke_rank, world_size, timeout=60))


def check() -> int:
    """Print the report; returns 0 when every component imports and the smoke test passes."""
    console = Console()
    table = Table(title="Colossal packages")
    for col in ("package", "version", "status"):
        table.add_column(col)
    rows = _component_rows()
    for row in rows:
        table.add_row(*row)
    console.print(table)
    foreign = foreign_colossalai()
    if foreign:
        console.print(foreign, style="bold red", markup=False, highlight=False)
    cuda = torch.cuda.is_available()
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    console.print(f"python {platform.python_version()}  torch {torch.__version__}")
    console.print(f"devices: cpu x {torch.get_num_threads()} threads; cuda: {devices or 'none'}")
    backends = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(), "mpi": dist.is_mpi_available()}
    console.print("backends: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in backends.items()))
    ok = smoke_test(2)
    console.print(f"2-process gloo all_reduce smoke test: {'passed' if ok else 'FAILED'}")
    return 0 if ok and not foreign and all(r[2] == "ok" for r in rows) else 1
