"""``colossalai check``: installed components and versions, torch, devices, backends, and a
two-process gloo smoke test."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

__all__ = ["check", "COMPONENTS"]

COMPONENTS = {
    "colossalai": "colossalai",
    "colossal-comm": "colossal.comm",
    "colossal-optim": "colossal.optim",
    "colossal-zero": "colossal.zero",
    "colossal-gemini": "colossal.gemini",
    "colossal-tensor-parallel": "colossal.tensor_parallel",
    "colossal-profiler": "colossal.profiler",
    "fastfold": "fastfold",
}
"""Distribution name -> import name of every Colossal package."""


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
    cuda = torch.cuda.is_available()
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    console.print(f"python {platform.python_version()}  torch {torch.__version__}")
    console.print(f"devices: cpu x {torch.get_num_threads()} threads; cuda: {devices or 'none'}")
    backends = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(), "mpi": dist.is_mpi_available()}
    console.print("backends: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in backends.items()))
    ok = smoke_test(2)
    console.print(f"2-process gloo all_reduce smoke test: {'passed' if ok else 'FAILED'}")
    return 0 if ok and all(r[2] == "ok" for r in rows) else 1
