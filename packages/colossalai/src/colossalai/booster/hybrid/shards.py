"""Where every element of a tensor-parallel parameter comes from, and what that gives the hybrid
plugin: dense checkpoints (gather / re-split) and the dense gradient norm (each element once).

[Note: shard index maps]
2D, 2.5D and 3D layers hold blocks of their dense parameters in mode-specific layouts (row and
column blocks, vectors split over ``q^2`` ranks, weights replicated over the 2.5D depth, position
embeddings replicated over grid rows). Rather than re-deriving each layer's layout, the plugin
converts a float64 copy of the dense model whose every parameter holds ``arange(numel)`` with the
same ``parallelize`` call: each local "parameter" of that copy is then exactly the flat dense
index of every local element (kept compact: ``[Note: compact index maps]``). Gathering is an
all-gather of values and indices over the tp group and a scatter into the dense tensor (replicas
write equal values);
re-splitting is one ``take``. Correct for any plan, by construction.

[Note: compact index maps]
A map with one int per local element would live as long as the model and cost 4 bytes per element
(GPT-2 16 x 512 under tp2: about 100 MiB per rank, more than the bf16 weights). But every layout
the plugin builds gives a weight a block of rows and a block of columns of the dense matrix
(permuted, transposed as GPT-2's ``Conv1D`` is, or split over a 2D / 2.5D / 3D grid): its index is
*separable*, ``index[i, j] = rows[i] + cols[j]``. Such a map is kept as those two vectors (rows +
cols ints instead of rows x cols), checked equal to the full map when it is built; any other map
(a 1-D bias is already small, a 4-D patch projection) is kept whole. The full map of one parameter
is rebuilt only while that parameter is gathered or split.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
from torch import nn

from colossalai.booster.wrappers import BoostedOptimizer

__all__ = ["ShardIndex", "TensorParallelOptimizer", "multiplicity"]


def _compact(index: torch.Tensor) -> tuple:
    """``index`` (the flat dense index of each local element) as ``("rows+cols", rows, cols)`` when
    it is separable, ``index[i, j] == rows[i] + cols[j]`` (checked exactly), else ``("full",
    index)`` in int32 where the values fit ([Note: compact index maps])."""
    if index.is_meta:  # another pipeline stage's parameter: never gathered or split here
        return ("full", index)
    small = index.numel() == 0 or int(index.max()) < 2**31
    narrow = (lambda t: t.to(torch.int32)) if small else (lambda t: t)  # noqa: E731
    if index.dim() == 2 and index.numel() > 0:
        rows, cols = index[:, 0], index[0, :] - index[0, 0]
        if torch.equal(rows[:, None] + cols[None, :], index):
            return ("rows+cols", narrow(rows), narrow(cols))
    return ("full", narrow(index))


def multiplicity(local: torch.Tensor, dense_shape: torch.Size, group_size: int) -> int:
    """How many ranks of a ``group_size`` group hold each element (even layouts): 1 = sharded,
    ``group_size`` = replicated, in between for partial replication (2.5D depth, 2D positions)."""
    copies, rem = divmod(local.numel() * group_size, max(dense_shape.numel(), 1))
    assert rem == 0 and copies >= 1, (tuple(local.shape), tuple(dense_shape), group_size)
    return copies


class ShardIndex:
    """Flat dense index of every local element of every parameter (see ``[Note: shard index maps]``)."""

    def __init__(self, dense: nn.Module, convert, group) -> None:
        probe = copy.deepcopy(dense)
        with torch.no_grad():
            for p in probe.parameters():  # unique parameters: ties stay tied
                p.data = torch.arange(p.numel(), dtype=torch.float64, device=p.device).view(p.shape)
        with torch.random.fork_rng(devices=[]):  # conversion must not move the training RNG
            convert(probe)
        self.group = group
        self.dense_shapes = {n: p.shape for n, p in dense.named_parameters(remove_duplicate=False)}
        self._maps = {n: _compact(p.detach().round().long()) for n, p in probe.named_parameters(remove_duplicate=False)}
        del probe

    def _index(self, name: str) -> torch.Tensor:
        """The flat dense index of every local element of parameter ``name`` (built from its map)."""
        kind, *parts = self._maps[name]
        if kind == "rows+cols":  # [Note: compact index maps]
            rows, cols = parts
            return rows.long()[:, None] + cols.long()[None, :]
        return parts[0].long()

    @property
    def nbytes(self) -> int:
        """Bytes the maps keep for the model's lifetime."""
        return sum(t.numel() * t.element_size() for _, *parts in self._maps.values() for t in parts)

    def __contains__(self, name: str) -> bool:
        return name in self._maps

    def gather(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The dense tensor of parameter ``name`` (or of a parameter-shaped state) from every rank's block."""
        from colossal.comm import all_gather

        values = all_gather(local.detach().reshape(-1).contiguous(), self.group)
        index = all_gather(self._index(name).reshape(-1).to(local.device), self.group).long()
        dense = torch.empty(self.dense_shapes[name].numel(), dtype=local.dtype, device=local.device)
        dense[index] = values
        return dense.view(self.dense_shapes[name])

    def split(self, name: str, dense: torch.Tensor) -> torch.Tensor:
        """This rank's block of the dense tensor of parameter ``name``."""
        shape = self.dense_shapes[name]
        if tuple(dense.shape) != tuple(shape):
            raise ValueError(f"state {name!r}: expected the dense shape {tuple(shape)}, got {tuple(dense.shape)}")
        index = self._index(name)
        return dense.reshape(-1).to(index.device).take(index)

    def replicas(self, name: str, local: torch.Tensor) -> int:
        """:func:`multiplicity` of parameter ``name`` over the tp group."""
        return multiplicity(local, self.dense_shapes[name], dist.get_world_size(self.group))


class TensorParallelOptimizer(BoostedOptimizer):
    """Clips by the norm of the *dense* gradients: every gradient element is counted once, whether
    it is sharded over the tp group, replicated on all of it (LayerNorms in 1D), or held by
    ``m`` of its ranks (2.5D depth, 2D position embedding: weighted by ``m^(-1/p)``).
    ``colossal.optim.grad_norm`` does the reduction. With a loss ``scaler`` (fp16) the overflow
    check is agreed over the group, whose ranks hold different blocks of the gradients."""

    def __init__(
        self, optimizer, replicas: list[tuple[nn.Parameter, int]], group, group_size: int, scaler=None
    ) -> None:
        super().__init__(optimizer, scaler)
        self.replicas, self.tp_group, self.group_size = replicas, group, group_size

    def _split(self, p: float) -> tuple[list, list]:
        sharded, replicated = [], []
        for param, m in self.replicas:
            if param.grad is None:
                continue
            if m == self.group_size:  # on every rank of the group: counted once
                replicated.append(param.grad)
            elif m == 1 or p == float("inf"):  # a max is not changed by duplicates
                sharded.append(param.grad)
            else:
                sharded.append(param.grad * m ** (-1.0 / p))
        return sharded, replicated

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Total norm of the dense gradients (identical on every rank), clipped in place."""
        from colossal.optim import grad_norm

        self._unscale()
        sharded, replicated = self._split(float(norm_type))
        total = grad_norm(sharded, norm_type, group=self.tp_group, replicated=replicated)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for param, _ in self.replicas:
            if param.grad is not None:
                param.grad.mul_(coef.to(param.grad.device))
        return total

    def step(self, *args, **kwargs) -> None:
        """Unscale, then step unless a gradient overflowed on any rank of the group (every rank
        then skips and backs the scale off together); fp32/bf16: a plain step."""
        if self.scaler is None:
            return super().step(*args, **kwargs)
        from colossal.comm import all_reduce
        from colossal.optim import has_inf_or_nan

        self._unscale()
        reduce = functools.partial(all_reduce, tag="hybrid.overflow")
        found_inf = has_inf_or_nan(self._grads(), self.tp_group, all_reduce=reduce)
        self.scaler.update(found_inf)
        self.last_step_skipped = found_inf
        if not found_inf:
            self.optim.step(*args, **kwargs)
        self._unscaled = False
