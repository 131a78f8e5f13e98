"""The Evoformer trunk modules (OpenFold parameter naming)."""

from fastfold.model.evoformer import EvoformerBlock, EvoformerStack
from fastfold.model.extra_msa import ExtraMSABlock, ExtraMSAStack
from fastfold.model.msa import MSAAttention, MSAColumnAttention, MSAColumnGlobalAttention, MSARowAttentionWithPairBias
from fastfold.model.outer_product_mean import OuterProductMean
from fastfold.model.pair_stack import PairStack
from fastfold.model.primitives import Attention, GlobalAttention, Linear
from fastfold.model.template import TemplatePairBlock, TemplatePairStack
from fastfold.model.transition import MSATransition, PairTransition, Transition
from fastfold.model.triangle import (
    TriangleAttention,
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
    TriangleMultiplicativeUpdate,
)

__all__ = [
    "Attention",
    "EvoformerBlock",
    "EvoformerStack",
    "ExtraMSABlock",
    "ExtraMSAStack",
    "GlobalAttention",
    "Linear",
    "MSAAttention",
    "MSAColumnAttention",
    "MSAColumnGlobalAttention",
    "MSARowAttentionWithPairBias",
    "MSATransition",
    "OuterProductMean",
    "PairStack",
    "PairTransition",
    "TemplatePairBlock",
    "TemplatePairStack",
    "Transition",
    "TriangleAttention",
    "TriangleAttentionEndingNode",
    "TriangleAttentionStartingNode",
    "TriangleMultiplicationIncoming",
    "TriangleMultiplicationOutgoing",
    "TriangleMultiplicativeUpdate",
]
