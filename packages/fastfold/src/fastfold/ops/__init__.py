"""Fused operators of the Evoformer with a pure-torch path and a compiled path (see
:mod:`fastfold.ops.backend`)."""

from fastfold.ops.attention import attention_core, training_kernels
from fastfold.ops.backend import OpsBackend, get_ops_backend, set_ops_backend
from fastfold.ops.bias_dropout_add import bias_dropout_add, sigmoid_gate
from fastfold.ops.layer_norm import LayerNorm, layer_norm
from fastfold.ops.softmax import mask_bias, softmax_with_biases

__all__ = [
    "LayerNorm",
    "OpsBackend",
    "attention_core",
    "bias_dropout_add",
    "get_ops_backend",
    "layer_norm",
    "mask_bias",
    "set_ops_backend",
    "sigmoid_gate",
    "softmax_with_biases",
    "training_kernels",
]
