"""Input checks run identically on every rank before any collective (clear errors, no hangs)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from colossal.comm import ensure_process_group, group_ranks
from colossal.optim import check_shardable
from colossal.zero.config import ZeroConfig

__all__ = ["validate"]


def validate(optimizer: torch.optim.Optimizer, model: nn.Module, config: ZeroConfig) -> torch.device:
    """Check the arguments of :class:`~colossal.zero.ZeroOptimizer`; return the parameters' device."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    check_shardable(optimizer, "ZeroOptimizer")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if getattr(model, "_colossal_zero", None) is not None:
        raise ValueError("model is already managed by a ZeroOptimizer; wrap each model once")
    ensure_process_group("ZeroOptimizer")  # a plain process: a world of one, as GeminiDDP and the plugins
    _check_groups(config)
    _check_optimizer_params(optimizer, model)
    return _check_device(model, config)


def _check_groups(config: ZeroConfig) -> None:
    rank = dist.get_rank()
    for name in ("group", "replicate_group"):
        g = getattr(config, name)
        if g is not None and rank not in group_ranks(g):
            raise ValueError(f"{name}: this rank ({rank}) is not a member of it (ranks {group_ranks(g)})")
    if config.replicate_group is not None:
        shared = set(group_ranks(config.group)) & set(group_ranks(config.replicate_group))
        if shared != {rank}:
            raise ValueError(
                f"group and replicate_group must meet in exactly this rank ({rank}), they share {sorted(shared)}"
            )


def _check_optimizer_params(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    if optimizer.state:
        raise ValueError(
            f"optimizer already has state for {len(optimizer.state)} parameters; wrap it before the first step"
        )
    in_model = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in in_model:
                raise ValueError(
                    f"optimizer param group {gi} holds a parameter of shape {tuple(p.shape)} that is not a "
                    "parameter of model; build the optimizer over model.parameters()"
                )
            if id(p) in seen:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} appears twice in the optimizer")
            seen.add(id(p))
    if not seen:
        raise ValueError("optimizer has no parameters")


def _check_device(model: nn.Module, config: ZeroConfig) -> torch.device:
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        raise ValueError(f"all model parameters must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    backend = dist.get_backend(config.group)
    if device.type == "meta":
        raise ValueError("model parameters are on the meta device; materialise them first")
    if "nccl" in str(backend) and device.type != "cuda":
        raise ValueError(f"the group's backend is {backend}: expected the model on cuda, got {device}")
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        raise ValueError(f"model is on {device}, expected this rank's device cuda:{torch.cuda.current_device()}")
    bad = [n for n, p in model.named_parameters() if not p.is_floating_point()]
    if bad:
        raise TypeError(f"parameters must be floating point; not so: {bad[:3]}")
    return device
