"""Dynamic axial parallelism for the Evoformer (see :mod:`fastfold.parallel.dap`)."""

from fastfold.parallel.dap import AsyncTensor, Dap, pad_axis, reduce_gradients

__all__ = ["AsyncTensor", "Dap", "pad_axis", "reduce_gradients"]
