"""What ``Booster.boost`` hands back: a model that runs under autocast and an optimizer that owns
the backward pass (loss scaling, unscale-once, skip on overflow, gradient clipping)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from colossal.optim import OptimizerWrapper
from colossalai.booster.precision import Precision

__all__ = ["BoostedModel", "BoostedOptimizer", "EngineBoostedOptimizer"]


class BoostedModel(nn.Module):
    """Wraps the plugin's model (e.g. a ``DistributedDataParallel``); forward runs under autocast.

    ``unwrap()`` gives back the user's original module.

    [Note: a boosted model's names]
    The module tree nests the user's module under the wrappers (``module.`` for this wrapper,
    another ``module.`` for DDP), so torch's own ``state_dict`` would read ``module.module.fc.weight``
    where plain PyTorch gives ``fc.weight``. ``state_dict``, ``load_state_dict``,
    ``named_parameters`` and ``named_buffers`` therefore speak the user's names, as the checkpoint
    files of ``Booster.save_model`` do; ``named_modules`` (and so ``apply``, ``to``) still walks
    the real tree. Where the plugin's engine holds the real values outside the module's tensors
    (ZeRO: stage-3 parameters are freed between uses, offloaded fp32 masters are what the next step
    reads; ``Plugin.owns_model_state``), ``state_dict`` gathers the engine's full state (collective:
    call on every rank) and ``load_state_dict`` scatters into it, so neither reads a freed
    placeholder nor writes values the next step would overwrite.
    """

    def __init__(
        self, module: nn.Module, original: nn.Module, precision: Precision, device: torch.device, plugin=None
    ) -> None:
        super().__init__()
        self.module = module
        # Kept outside the module tree (no duplicate parameters in .parameters()).
        self.__dict__["_original"] = original
        self.__dict__["_plugin"] = plugin
        self.precision = precision
        self.device = device
        self._register_load_state_dict_pre_hook(self._user_keys_to_tree)

    def unwrap(self) -> nn.Module:
        """The user's module, without plugin wrappers."""
        return self._original

    def _engine_owns_state(self) -> bool:
        # An engine that keeps parameters outside its module tree (Gemini's chunks) defines its own
        # state_dict; torch's recursion would only see the empty placeholders and return nothing.
        return type(self.module).state_dict is not nn.Module.state_dict

    def state_dict(self, *args, **kwargs):
        """The model's state dict under the user's own names (what the unboosted model gives, loadable
        into it with ``strict=True``; see ``[Note: a boosted model's names]``): the engine's own (full;
        collective, call on every rank) where it keeps parameters outside the module tree, as Gemini
        does; else the user's module's, whose tensors the plugin's wrapper (DDP) shares."""
        if self._engine_owns_state():
            return self.module.state_dict(*args, **kwargs)
        if getattr(self._plugin, "owns_model_state", False):
            full = self._plugin.full_model_state_dict(self.module)
            destination = kwargs.get("destination", args[0] if args else None)
            if destination is None:
                return full
            prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
            destination.update({prefix + k: v for k, v in full.items()})  # a parent module's state_dict
            return destination
        return self._original.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load what :meth:`state_dict` returns (the user's names), strict like
        ``torch.nn.Module.load_state_dict``; mismatches are reported under the user's names."""
        if self._engine_owns_state():
            return self.module.load_state_dict(state_dict, strict=strict)
        if getattr(self._plugin, "owns_model_state", False):
            return self._plugin.load_full_model_state_dict(self.module, state_dict, strict=strict)
        return self._original.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The user's module's parameters under its own names (``parameters()`` follows); the engine's
        placeholders where it keeps parameters outside the module tree."""
        if self._engine_owns_state():
            return super().named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)
        return self._original.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The user's module's buffers under its own names (``buffers()`` follows)."""
        if self._engine_owns_state():
            return super().named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)
        return self._original.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def _user_keys_to_tree(self, state_dict, prefix, *_args) -> None:
        """Load pre-hook for a boosted model nested in a parent module: the parent's
        ``load_state_dict`` walks the module tree, where the user's names sit under the wrappers'
        (``module.module.`` for DDP); rename the user's keys accordingly."""
        if self._engine_owns_state():
            return
        if getattr(self._plugin, "owns_model_state", False):  # the engine's masters hold the values
            mine = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
            self._plugin.load_full_model_state_dict(self.module, mine, strict=False)
        inner = next(name for name, m in super().named_modules() if m is self._original)
        if not inner:
            return
        for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(f"{prefix}{inner}.")]:
            state_dict[f"{prefix}{inner}.{key[len(prefix) :]}"] = state_dict.pop(key)

    def forward(self, *args, **kwargs):
        """Forward of the wrapped module, under autocast when the precision is not fp32."""
        ctx = (
            torch.autocast(self.device.type, dtype=self.precision.dtype)
            if self.precision is not Precision.FP32
            else contextlib.nullcontext()
        )
        with ctx:
            return self.module(*args, **kwargs)


class BoostedOptimizer(OptimizerWrapper):
    """Wraps a ``torch.optim.Optimizer``: ``backward(loss)``, ``step()``, ``zero_grad()``,
    ``clip_grad_norm(max_norm)``; every other attribute is the wrapped optimizer's.

    With a loss scaler (fp16) the loss is scaled in ``backward``; gradients are unscaled exactly
    once per step (in ``clip_grad_norm`` or ``step``), and a step with a non-finite gradient is
    skipped (``last_step_skipped``) while the scaler backs off.

    A ``torch.optim.Optimizer`` (``[Note: wrappers are optimizers]`` in ``colossal.optim.wrapper``):
    torch's LR schedulers and step hooks work on it directly.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scaler=None, params: list | None = None) -> None:
        self._wrap(optimizer)
        self.optim = optimizer
        self.scaler = scaler
        self.params = params if params is not None else [p for g in optimizer.param_groups for p in g["params"]]
        self._unscaled = False
        self.last_step_skipped = False

    def __getattr__(self, name):
        return getattr(self.__dict__["optim"], name)

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward()``, scaled when a loss scaler is present."""
        if self.scaler is not None:
            loss = self.scaler.scale_loss(loss)
        loss.backward(**kwargs)

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def _unscale(self) -> None:
        if self.scaler is not None and not self._unscaled:
            self.scaler.unscale_(self._grads())
        self._unscaled = True

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the (unscaled) gradients to ``max_norm``; returns the total norm before clipping."""
        self._unscale()
        return torch.nn.utils.clip_grad_norm_(self.params, max_norm, norm_type)

    def step(self, *args, **kwargs) -> None:
        """Unscale, then step unless a gradient overflowed (fp16); updates the loss scale."""
        self._unscale()
        found_inf = False
        if self.scaler is not None:
            grads = self._grads()
            found_inf = bool(grads) and not all(torch.isfinite(g).all() for g in grads)
            self.scaler.update(found_inf)
        self.last_step_skipped = found_inf
        if not found_inf:
            self.optim.step(*args, **kwargs)
        self._unscaled = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients."""
        self.optim.zero_grad(set_to_none=set_to_none)

    def unwrap(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self.optim

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict."""
        return self.optim.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Load the wrapped optimizer's state dict."""
        self.optim.load_state_dict(state)


class EngineBoostedOptimizer(BoostedOptimizer):
    """The Booster's view of a sharding engine's optimizer (ZeRO, Gemini): the engine scales the
    loss, checks overflow, clips and steps itself, so every call is delegated to it."""

    def __init__(self, engine, inner: torch.optim.Optimizer) -> None:
        super().__init__(inner, scaler=engine.scaler, params=[])
        self.engine = engine
        self._restore_clip = None  # undoes a clip_grad_norm() after the step it applies to

    def _clip_next_step(self, **settings) -> None:
        """Set engine clip ``settings`` for the next ``step()`` only (the engine clips inside it)."""
        if self._restore_clip is None:
            before = {k: getattr(self.engine_clip_target, k) for k in settings}
            self._restore_clip = lambda: [setattr(self.engine_clip_target, k, v) for k, v in before.items()]
        for k, v in settings.items():
            setattr(self.engine_clip_target, k, v)

    @property
    def engine_clip_target(self):
        """The object holding the engine's clip settings (the engine itself unless overridden)."""
        return self.engine

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """Scaled backward through the engine's hooks."""
        self.engine.backward(loss)

    def step(self, *args, **kwargs) -> None:
        """One engine step (skipped on every rank when a gradient overflowed)."""
        try:
            self.last_step_skipped = not self.engine.step()
        finally:
            if self._restore_clip is not None:  # clip_grad_norm() applies to this step only
                self._restore_clip()
                self._restore_clip = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated gradients."""
        self.engine.zero_grad(set_to_none)

    def unwrap(self):
        """The engine (``ZeroOptimizer`` / ``GeminiOptimizer``)."""
        return self.engine

    def state_dict(self) -> dict:
        """The engine's full optimizer state in ``torch.optim``'s form (collective: every rank calls it)."""
        return self.engine.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Load a full ``torch.optim``-form state into the engine (every rank passes the full dict)."""
        self.engine.load_state_dict(state)
