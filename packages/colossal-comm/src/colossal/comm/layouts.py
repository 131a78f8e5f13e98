"""Tensor-parallel sub-layouts of one mesh axis: 2D, 2.5D and 3D.

Each layout splits the ``P`` ranks of one axis (say ``tp``) into a grid and returns the groups
the parallel layers of that mode need. "Index" below is the rank *within the axis group*
(``mesh.coordinate(axis)``); groups are listed by the indices they hold.

**2D** (SUMMA / Optimus), ``P = q*q``, index ``= i*q + j`` (``i`` row, ``j`` column):

* ``row``: same ``i``, ``j`` varying: ``{i*q + j' : j'}``; group rank = ``j``
* ``col``: same ``j``, ``i`` varying: ``{i'*q + j : i'}``; group rank = ``i``

**2.5D** (Tesseract), ``P = q*q*d``, index ``= k*q*q + i*q + j`` (``k`` depth):

* ``row``: same ``k, i``, ``j`` varying; group rank = ``j``
* ``col``: same ``k, j``, ``i`` varying; group rank = ``i``
* ``dep``: same ``i, j``, ``k`` varying; group rank = ``k``
* ``xz``: same ``j``, ``(k, i)`` varying; group rank = ``k*q + i`` (the col x dep product)

**3D**, ``P = q*q*q``, index ``= a*q*q + b*q + c`` (``a`` input, ``b`` weight, ``c`` output
coordinate):

* ``input``: same ``b, c``, ``a`` varying; group rank = ``a``
* ``weight``: same ``a, c``, ``b`` varying; group rank = ``b``
* ``output``: same ``a, b``, ``c`` varying; group rank = ``c``
* ``input_x_weight``: same ``c``, ``(a, b)`` varying; group rank = ``a*q + b``
* ``output_x_weight``: same ``a``, ``(b, c)`` varying; group rank = ``b*q + c``

Group ranks always follow ascending global rank (torch sorts a group's members), which is what
the "group rank" formulas above state. Every group is created on every rank (``new_group`` is
collective) through ``DeviceMesh``, once per mesh (``Mesh.layout`` caches).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import torch
from torch.distributed import ProcessGroup

from colossal.comm.submesh import sub_device_mesh

__all__ = ["Layout2D", "Layout2p5D", "Layout3D", "build_layout"]


class AxisGrid(Protocol):
    """What a layout reads of a :class:`~colossal.comm.Mesh` (named here, not imported: the mesh
    module imports this one to build its layouts)."""

    names: tuple[str, ...]
    rank_grid: torch.Tensor
    device_type: str

    def size(self, axis: str) -> int: ...

    def coordinate(self, axis: str) -> int: ...


@dataclasses.dataclass(frozen=True)
class Layout2D:
    """2D grid of one axis: ``P = q*q``."""

    q: int
    """Grid side."""
    row_index: int
    """This rank's ``i``."""
    col_index: int
    """This rank's ``j``."""
    row: ProcessGroup
    """Same ``i``, ``j`` varying."""
    col: ProcessGroup
    """Same ``j``, ``i`` varying."""


@dataclasses.dataclass(frozen=True)
class Layout2p5D:
    """2.5D grid of one axis: ``P = q*q*d``."""

    q: int
    """Grid side."""
    depth: int
    """Number of stacked ``q x q`` layers (``d``)."""
    row_index: int
    """This rank's ``i``."""
    col_index: int
    """This rank's ``j``."""
    dep_index: int
    """This rank's ``k``."""
    row: ProcessGroup
    """Same ``k, i``, ``j`` varying."""
    col: ProcessGroup
    """Same ``k, j``, ``i`` varying."""
    dep: ProcessGroup
    """Same ``i, j``, ``k`` varying."""
    xz: ProcessGroup
    """Same ``j``, ``(k, i)`` varying."""


@dataclasses.dataclass(frozen=True)
class Layout3D:
    """3D cube of one axis: ``P = q*q*q``."""

    q: int
    """Cube side."""
    input_index: int
    """This rank's ``a``."""
    weight_index: int
    """This rank's ``b``."""
    output_index: int
    """This rank's ``c``."""
    input: ProcessGroup
    """Same ``b, c``, ``a`` varying."""
    weight: ProcessGroup
    """Same ``a, c``, ``b`` varying."""
    output: ProcessGroup
    """Same ``a, b``, ``c`` varying."""
    input_x_weight: ProcessGroup
    """Same ``c``, ``(a, b)`` varying."""
    output_x_weight: ProcessGroup
    """Same ``a``, ``(b, c)`` varying."""


def _side(p: int, power: int, what: str, axis: str, depth: int = 1) -> int:
    q = round((p / depth) ** (1 / power))
    if q < 1 or q**power * depth != p:
        need = "q*q*d" if depth > 1 or what == "2.5d" else "q" + "*q" * (power - 1)
        raise ValueError(f"{what} layout needs the size of axis {axis!r} to be {need}; got {p} (depth={depth})")
    return q


def build_layout(mesh: AxisGrid, kind: str, axis: str, depth: int = 1):
    """Build the ``kind`` layout (``"2d"``, ``"2.5d"``, ``"3d"``) of ``mesh``'s ``axis``."""
    p = mesh.size(axis)
    if kind == "2d":
        q = _side(p, 2, kind, axis)
        g = _groups(mesh, axis, {"i": q, "j": q}, {"row": ("j",), "col": ("i",)})
        idx = mesh.coordinate(axis)
        return Layout2D(q, idx // q, idx % q, g["row"], g["col"])
    if kind == "2.5d":
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"2.5d layout needs depth >= 1, got {depth!r}")
        q = _side(p, 2, kind, axis, depth)
        g = _groups(
            mesh,
            axis,
            {"k": depth, "i": q, "j": q},
            {"row": ("j",), "col": ("i",), "dep": ("k",), "xz": ("k", "i")},
        )
        idx = mesh.coordinate(axis)
        return Layout2p5D(q, depth, idx // q % q, idx % q, idx // (q * q), g["row"], g["col"], g["dep"], g["xz"])
    if kind == "3d":
        q = _side(p, 3, kind, axis)
        g = _groups(
            mesh,
            axis,
            {"a": q, "b": q, "c": q},
            {
                "input": ("a",),
                "weight": ("b",),
                "output": ("c",),
                "input_x_weight": ("a", "b"),
                "output_x_weight": ("b", "c"),
            },
        )
        idx = mesh.coordinate(axis)
        return Layout3D(
            q,
            idx // (q * q),
            idx // q % q,
            idx % q,
            *(g[n] for n in ("input", "weight", "output", "input_x_weight", "output_x_weight")),
        )
    raise NotImplementedError(f"layout kind {kind!r} is not supported; supported: '2d', '2.5d', '3d'")


def _groups(
    mesh: AxisGrid, axis: str, split: dict[str, int], wanted: dict[str, tuple[str, ...]]
) -> dict[str, ProcessGroup]:
    """Split ``axis`` of the rank grid into ``split`` (row-major) and build one group per
    ``wanted`` entry: the ranks that differ only along its listed sub-dimensions."""
    assert math.prod(split.values()) == mesh.size(axis)
    grid = mesh.rank_grid
    ax = mesh.names.index(axis)
    grid = grid.reshape(*grid.shape[:ax], *split.values(), *grid.shape[ax + 1 :])
    names = (*mesh.names[:ax], *split, *mesh.names[ax + 1 :])
    out = {}
    for group_name, dims in wanted.items():
        dm = sub_device_mesh(mesh.device_type, grid, names, dims, group_name)
        out[group_name] = dm.get_group(group_name)
    return out
