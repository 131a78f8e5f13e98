"""The N-D process-group mesh: named axes over all ranks, built on ``DeviceMesh``.

Ranks are laid out **row-major** over the axes in the order given, the last axis varying
fastest: with ``Mesh(axes={"dp": 2, "tp": 4})`` rank ``r`` sits at ``dp = r // 4``,
``tp = r % 4``, so each tensor-parallel group holds consecutive ranks (the usual choice: the
most talkative axis stays inside a host).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from colossal.comm.layouts import build_layout
from colossal.comm.submesh import sub_device_mesh

__all__ = ["Axis", "Mesh"]


class Axis(enum.StrEnum):
    """Conventional axis names; any other non-empty name is allowed too."""

    DP = "dp"
    """Data parallel: replicas (or ZeRO/Gemini shards) that see different batches."""
    PP = "pp"
    """Pipeline parallel: consecutive stages of the model."""
    TP = "tp"
    """Tensor parallel: one layer's weights split across ranks."""
    SP = "sp"
    """Sequence parallel: one sequence split across ranks."""


def _infer_sizes(axes: dict[str, int], world_size: int) -> dict[str, int]:
    """Validate names and sizes and fill in a single ``-1``; raises ``ValueError`` naming them."""
    if not axes:
        raise ValueError("a mesh needs at least one axis, got none")
    for name, size in axes.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"axis names must be non-empty strings, got {name!r}")
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
            raise ValueError(f"axis {name!r} has size {size!r}; sizes must be positive ints or -1")
    unknown = [n for n, s in axes.items() if s == -1]
    if len(unknown) > 1:
        raise ValueError(f"only one axis may be -1 (inferred), got {unknown}")
    known = math.prod(s for s in axes.values() if s != -1)
    if unknown:
        if world_size % known:
            raise ValueError(
                f"cannot infer axis {unknown[0]!r}: world size {world_size} is not divisible by {known} ({axes})"
            )
        axes = {n: (world_size // known if s == -1 else s) for n, s in axes.items()}
    elif known != world_size:
        raise ValueError(f"mesh sizes {axes} multiply to {known}, but the world size is {world_size}")
    return dict(axes)


@dataclasses.dataclass(kw_only=True, slots=True)
class Mesh:
    """Named process-group axes over every rank of the default group.

    Validation happens in ``__post_init__`` before any collective, identically on every rank,
    so a bad shape raises the same ``ValueError`` everywhere instead of hanging.
    """

    axes: dict[str, int]
    """Axis name -> size, outermost first; one size may be ``-1`` (inferred from the world size)."""
    device_type: str | None = None
    """``"cuda"`` or ``"cpu"``; default: ``"cuda"`` when the backend is NCCL, else ``"cpu"``."""
    world_size: int | None = None
    """Checked against ``torch.distributed``'s world size; default: that world size."""
    device_mesh: DeviceMesh = dataclasses.field(init=False, repr=False)
    """The underlying ``DeviceMesh`` (its dimension names are the axis names)."""
    _cache: dict[Any, Any] = dataclasses.field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.axes, dict):
            raise TypeError(f"axes must be a dict of name -> size, got {type(self.axes).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call colossal.comm.launch() first")
        actual = dist.get_world_size()
        if self.world_size is not None and self.world_size != actual:
            raise ValueError(f"world_size={self.world_size} but torch.distributed has {actual} ranks")
        self.world_size = actual
        self.axes = _infer_sizes(self.axes, actual)
        if self.device_type is None:
            self.device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        ranks = torch.arange(actual).reshape(tuple(self.axes.values()))
        self.device_mesh = DeviceMesh(self.device_type, ranks, mesh_dim_names=tuple(self.axes))

    @property
    def names(self) -> tuple[str, ...]:
        """Axis names, outermost first."""
        return tuple(self.axes)

    @property
    def rank_grid(self) -> torch.Tensor:
        """Global ranks as a tensor of shape ``tuple(axes.values())``."""
        return torch.arange(self.world_size).reshape(tuple(self.axes.values()))

    def _check_axis(self, axis: str) -> str:
        if axis not in self.axes:
            raise ValueError(f"unknown mesh axis {axis!r}; this mesh has {list(self.axes)}")
        return str(axis)

    def group(self, axis: str) -> ProcessGroup:
        """This rank's process group along ``axis``."""
        return self.device_mesh.get_group(self._check_axis(axis))

    def size(self, axis: str) -> int:
        """Number of ranks along ``axis``."""
        return self.axes[self._check_axis(axis)]

    def coordinate(self, axis: str) -> int:
        """This rank's index along ``axis`` (its rank within ``group(axis)``)."""
        return self.device_mesh.get_local_rank(self._check_axis(axis))

    def coordinates(self) -> dict[str, int]:
        """This rank's index along every axis."""
        return {a: self.coordinate(a) for a in self.axes}

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along ``axis``, in group-rank order."""
        return dist.get_process_group_ranks(self.group(axis))

    def product_group(self, *axes: str) -> ProcessGroup:
        """One group spanning several axes (e.g. ``("dp", "sp")`` for gradient reduction).

        Group ranks follow ascending global rank (torch sorts group members). Built once and cached.
        """
        for a in axes:
            self._check_axis(a)
        if len(set(axes)) != len(axes) or not axes:
            raise ValueError(f"product_group needs distinct axes, got {axes}")
        if len(axes) == 1:
            return self.group(axes[0])
        key = ("product", axes)
        if key not in self._cache:
            self._cache[key] = sub_device_mesh(self.device_type, self.rank_grid, self.names, axes, "x".join(axes))
        return self._cache[key].get_group("x".join(axes))

    def layout(self, kind: str, axis: str = "tp", depth: int = 1):
        """The 2D / 2.5D / 3D tensor-parallel sub-layout of ``axis`` (``kind`` in ``"2d"``,
        ``"2.5d"``, ``"3d"``), built once and cached. See :mod:`colossal.comm.layouts`."""
        key = ("layout", kind, axis, depth)
        if key not in self._cache:
            self._cache[key] = build_layout(self, kind, axis, depth)
        return self._cache[key]
