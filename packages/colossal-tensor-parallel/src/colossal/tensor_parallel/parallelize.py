"""One entry for every mode: :func:`parallelize` converts a model in place, in the manner of
``torch.distributed.tensor.parallel.parallelize_module``, by calling the mode's ``apply_*``.

Order of work inside (it matters): the mode's layout is built (a collective, so the world size is
validated first, identically on every rank); then every replacement module is built and every
shape checked before the model is touched; then the modules are swapped; dropouts last, since
their RNG stream depends on whether the mode leaves the activations replicated or split.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from colossal.comm import Layout2D, Layout2p5D, Layout3D, Mesh
from colossal.tensor_parallel.one_d import apply_1d
from colossal.tensor_parallel.plan import replace_module
from colossal.tensor_parallel.rng import DropoutMode, ParallelDropout, RNGTracker
from colossal.tensor_parallel.sequence import apply_sequence
from colossal.tensor_parallel.three_d import apply_3d
from colossal.tensor_parallel.two_d import apply_2d
from colossal.tensor_parallel.two_p5_d import apply_2p5d

__all__ = ["MODES", "parallelize", "convert_dropouts", "dropout_mode"]

MODES = ("1d", "2d", "2.5d", "3d", "sequence")
"""Mode names accepted by :func:`parallelize`."""


def dropout_mode(mode: str) -> DropoutMode:
    """Where ``mode`` leaves a block's activations: replicated (1D) or split (every other mode)."""
    return DropoutMode.REPLICATED if mode == "1d" else DropoutMode.SPLIT


def convert_dropouts(model: nn.Module, tracker: RNGTracker, mode: DropoutMode | str) -> nn.Module:
    """Replace every ``nn.Dropout`` of ``model`` by a :class:`ParallelDropout` on ``tracker``."""
    for name, module in list(model.named_modules()):
        if type(module) is nn.Dropout:
            replace_module(model, name, ParallelDropout.from_dense(module, tracker, mode))
    return model


def _group(target: ProcessGroup | Mesh, axis: str) -> ProcessGroup:
    return target.group(axis) if isinstance(target, Mesh) else target


def parallelize(
    model: nn.Module,
    mode: str,
    target: ProcessGroup | Mesh | Layout2D | Layout2p5D | Layout3D,
    plan: dict | None = None,
    *,
    axis: str = "tp",
    depth: int = 1,
    kind: str = "ring",
    rng: RNGTracker | None = None,
) -> nn.Module:
    """Convert ``model`` in place for ``mode`` (one of :data:`MODES`) and return it.

    ``target``: a ``ProcessGroup`` (1D, sequence), a ``Mesh`` (its ``axis`` is used; 2D/2.5D/3D lay
    it out), or a layout from ``Mesh.layout``. ``plan``: pattern -> :class:`Style` (default:
    ``gpt_plan(mode)``). ``depth``: 2.5D depth. ``kind``: sequence attention (``"ring"`` or
    ``"all_to_all"``). ``rng``: when given, dropouts draw from it (replicated or split stream as the
    mode requires).
    """
    if mode not in MODES:
        raise NotImplementedError(f"mode {mode!r} is not supported; supported: {list(MODES)}")
    with torch.profiler.record_function(f"colossal.tensor_parallel::parallelize_{mode}"):
        if mode == "1d":
            apply_1d(model, _group(target, axis), plan)
        elif mode == "sequence":
            apply_sequence(model, _group(target, axis), plan, kind)
        elif mode == "2d":
            apply_2d(model, target, plan, axis)
        elif mode == "2.5d":
            apply_2p5d(model, target, plan, axis, depth)
        else:
            apply_3d(model, target, plan, axis)
        if rng is not None:
            convert_dropouts(model, rng, dropout_mode(mode))
    return model
