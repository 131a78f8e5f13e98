"""The wrapped model's own ``state_dict()`` / ``load_state_dict()`` under ZeRO.

[Note: the wrapped model's own state dict]
A user who wraps their model with ``ZeroOptimizer`` keeps calling ``model.state_dict()`` and
``model.load_state_dict(...)``, as with plain PyTorch. Under stage 3 the parameters are empty
placeholders (their storage is freed between uses): torch's recursion would return tensors without
data, and ``torch.save`` writes a file of a few KB that no one can load. Under every stage the fp32
masters, not the parameters, are what the next step starts from: torch's copy into the parameters
would be overwritten by the next step. So the model's root module gets hooks (as FSDP's
FULL_STATE_DICT does): ``state_dict()`` returns the full, gathered parameters (stage 3; stages 1/2
return their parameters as they are, after the pending all-gathers), and ``load_state_dict()``
scatters the parameters into the masters and working shards (strict as torch: mismatches are
torch's ``_IncompatibleKeys`` / ``RuntimeError``). Both are then collective: every rank calls them
([Note: state is collective] in ``optimizer.py``). ``keep_vars=True`` returns the live parameters
(placeholders under stage 3), as torch and FSDP do. A submodule's ``state_dict()`` under stage 3
would hold placeholders too: it raises, naming the call to use, unless inside the root's call.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol

from torch import nn

__all__ = ["install_module_state_hooks"]


class _Engine(Protocol):
    """What these hooks need of a ``ZeroOptimizer`` (a protocol: optimizer.py imports this module)."""

    module: nn.Module
    config: Any

    def wait_params(self) -> None: ...
    def full_model_state_dict(self) -> dict: ...
    def load_full_model_state_dict(self, state_dict: dict, strict: bool = True) -> None: ...


_local = threading.local()  # per thread: the roots whose state_dict() is running, their keep_vars


def install_module_state_hooks(zero: _Engine) -> None:
    """Hook ``zero.module``'s ``state_dict``/``load_state_dict`` ([Note: the wrapped model's own state dict])."""
    ref, root = weakref.ref(zero), zero.module
    root.register_state_dict_pre_hook(lambda m, prefix, keep_vars: _enter(m, keep_vars))
    root.register_state_dict_post_hook(lambda m, sd, prefix, meta: _full_params(ref(), sd, prefix))
    root.register_load_state_dict_pre_hook(lambda m, sd, prefix, *rest: _load_params(ref(), sd, prefix))
    root.register_load_state_dict_post_hook(lambda m, keys: _drop_loaded(m, keys))
    if zero.config.stage == 3:
        for name, sub in root.named_modules():
            if sub is not root and any(True for _ in sub.parameters()):
                sub.register_state_dict_pre_hook(lambda m, prefix, keep_vars, name=name: _refuse_part(m, name))


def _stack() -> list:
    if not hasattr(_local, "roots"):
        _local.roots = []
    return _local.roots


def _enter(root: nn.Module, keep_vars: bool) -> None:
    _stack().append((root, keep_vars))


def _refuse_part(module: nn.Module, name: str) -> None:
    if not _stack():
        raise RuntimeError(
            f"{name}.state_dict() of a ZeRO stage-3 model would hold empty parameter placeholders; call the "
            "whole model's state_dict() (collective: every rank) or ZeroOptimizer.full_model_state_dict()"
        )


def _full_params(zero: _Engine | None, state_dict: dict, prefix: str) -> None:
    _, keep_vars = _stack().pop()
    if zero is None or keep_vars:  # the engine's own calls read the live parameters
        return
    zero.wait_params()  # stages 1/2: a pending all-gather still writes the parameters
    if zero.config.stage != 3:
        return
    names = {n for n, _ in zero.module.named_parameters(remove_duplicate=False)}
    full = zero.full_model_state_dict()
    for name in names:
        if prefix + name in state_dict:
            state_dict[prefix + name] = full[name]


def _load_params(zero: _Engine | None, state_dict: dict, prefix: str) -> None:
    """Scatter this model's parameters from ``state_dict`` into ZeRO (shapes checked there, in torch's
    words) and take them out of torch's own copy, which would write into the placeholders."""
    if zero is None:
        return
    mine = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    zero.load_full_model_state_dict(mine, strict=False)  # buffers too: every size is checked first
    params = [n for n, _ in zero.module.named_parameters(remove_duplicate=False) if n in mine]
    for n in params:
        state_dict.pop(prefix + n)
    zero._loaded_by_hook = {prefix + n for n in params}


def _drop_loaded(root: nn.Module, keys) -> None:
    """Parameters the pre-hook loaded are not missing."""
    zero = getattr(root, "_colossal_zero", lambda: None)()
    loaded = getattr(zero, "_loaded_by_hook", None)
    if loaded:
        keys.missing_keys[:] = [k for k in keys.missing_keys if k not in loaded]
        zero._loaded_by_hook = set()
