"""Dynamic axial parallelism for the Evoformer (see :mod:`fastfold.parallel.dap`)."""

from fastfold.parallel.dap import PAIR_A2A_TAG, AsyncTensor, Dap, pad_axis, reduce_gradients

__all__ = ["PAIR_A2A_TAG", "AsyncTensor", "Dap", "pad_axis", "reduce_gradients"]
