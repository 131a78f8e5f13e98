"""LAMB, LARS, CPU/Hybrid Adam, dynamic loss scaler and sharded gradient clipping.

``colossal.optim`` depends on torch alone. ZeRO and Gemini share its loss scalers and its
sharded gradient norm/clip, so that logic exists once.
"""

from .adam import CPUAdam, HybridAdam
from .grad_norm import clip_grad_norm_, grad_norm, group_norm_reducer, has_inf_or_nan
from .lamb import Lamb
from .lars import Lars
from .loss_scaler import ConstantLossScaler, DynamicLossScaler
from .param_groups import large_batch_param_groups
from .shardable import ELEMENTWISE, check_shardable
from .wrapper import OptimizerWrapper

__all__ = [
    "DynamicLossScaler",
    "ConstantLossScaler",
    "has_inf_or_nan",
    "grad_norm",
    "clip_grad_norm_",
    "group_norm_reducer",
    "Lamb",
    "Lars",
    "large_batch_param_groups",
    "CPUAdam",
    "HybridAdam",
    "ELEMENTWISE",
    "check_shardable",
    "OptimizerWrapper",
]
