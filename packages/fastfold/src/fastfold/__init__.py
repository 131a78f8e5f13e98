"""FastFold: the AlphaFold-2 Evoformer trunk with dynamic axial parallelism, chunked inference and
fused operators, loading OpenFold and AlphaFold parameters."""

from fastfold.config import EvoformerConfig, ExtraMSAConfig, TemplatePairConfig
from fastfold.model import EvoformerStack, ExtraMSAStack, TemplatePairStack
from fastfold.parallel import Dap, reduce_gradients

__all__ = [
    "Dap",
    "EvoformerConfig",
    "EvoformerStack",
    "ExtraMSAConfig",
    "ExtraMSAStack",
    "TemplatePairConfig",
    "TemplatePairStack",
    "reduce_gradients",
]
