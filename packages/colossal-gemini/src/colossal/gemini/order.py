"""Parameter order for packing: the order in which a forward pass first uses them.

[Note: packing in first-use order]
Chunks are fetched, gathered and evicted whole, so parameters used by consecutive operators should
share chunks: then one gather serves several operators and the prefetch window covers more of the
upcoming compute. Registration order (``module.parameters()``) is often the use order, but not
always (heads defined before the trunk, shared layers, modules reused out of order). With
``example_inputs`` the model's forward runs once at construction **on the meta device**
(``torch.func.functional_call`` with meta stand-ins for every parameter and buffer): no memory, no
compute, and it works for lazily constructed (meta) models too. A forward pre-hook on every module
that owns parameters records the order modules first run; their parameters follow in that order,
and parameters no module used come last, in registration order.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

__all__ = ["first_use_order"]


def _to_meta(x: Any) -> Any:
    return torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x


def first_use_order(module: nn.Module, params: list[nn.Parameter], example_inputs: tuple) -> list[nn.Parameter]:
    """``params`` reordered by first use in ``module(*example_inputs)`` (run on the meta device)."""
    own = {m: list(m.parameters(recurse=False)) for m in module.modules()}
    order: dict[nn.Parameter, None] = {}

    def record(m: nn.Module, args) -> None:
        for p in own[m]:
            order.setdefault(p)

    handles = [m.register_forward_pre_hook(record) for m, ps in own.items() if ps]
    named = itertools.chain(module.named_parameters(), module.named_buffers())  # tied names: functional_call ties them
    stand_ins = {n: _to_meta(t) for n, t in named}
    try:
        with torch.no_grad():
            torch.func.functional_call(module, stand_ins, tree_map(_to_meta, tuple(example_inputs)))
    except Exception as e:  # noqa: BLE001 - any failure of the user's forward on meta tensors
        raise ValueError(
            f"example_inputs: the forward pass on the meta device failed ({type(e).__name__}: {e}); "
            f"pass example_inputs=None to pack parameters in registration order"
        ) from e
    finally:
        for h in handles:
            h.remove()
    known = set(params)
    return [p for p in order if p in known] + [p for p in params if p not in order]
