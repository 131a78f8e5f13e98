"""Process groups over a product of mesh dimensions, as a ``DeviceMesh`` dimension.

Used by :class:`~colossal.comm.mesh.Mesh` (product groups such as ``dp x sp``) and by
:mod:`colossal.comm.layouts` (the 2D/2.5D/3D sub-groups of one axis); kept apart from both so that
neither imports the other's module for it.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["sub_device_mesh"]


def sub_device_mesh(
    device_type: str, grid: torch.Tensor, names: tuple[str, ...], merged: tuple[str, ...], merged_name: str
) -> DeviceMesh:
    """A DeviceMesh whose last dimension, ``merged_name``, is the row-major product of the
    ``merged`` dimensions of ``grid``; the other dimensions are flattened into ``"rest"``."""
    keep = [i for i, n in enumerate(names) if n not in merged]
    order = keep + [names.index(n) for n in merged]
    t = grid.permute(order).reshape(-1, math.prod(grid.shape[names.index(n)] for n in merged))
    return DeviceMesh(device_type, t, mesh_dim_names=("rest", merged_name))
