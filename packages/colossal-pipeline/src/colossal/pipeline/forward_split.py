"""The first and last stage run the model's own forward, cut at its blocks.

[Note: the user's forward, cut at the blocks]
Without ``embed=``/``head=``, a pipeline stage must compute exactly what the model's own forward
computes around the blocks: ``out * self.gain`` on a parameter of the model itself, a tied
projection ``x @ self.wte.weight.t()``, a scale. The forward is traced once by ``torch.fx`` with
every submodule a leaf (so only the model's own ``forward`` needs to be traceable, never the
blocks' or the layers'), and the graph is cut where it calls the blocks: the nodes that compute
the first block's input are the first stage's embed, the nodes after the last block the last
stage's head. The graph also says exactly which parameters and buffers each part reads (a leaf
call reads its module's tensors, a ``get_attr`` one tensor), so each lands on the stage whose code
uses it, wherever the model registered it.

The cut is refused, naming the reason, where the forward does something a stage cannot: calls a
block twice, out of order or with more than the hidden state, works on a block's output between
blocks (``x = x + layer(x)``: a stage runs its blocks one after another on the hidden state alone,
so the residual belongs inside the block), or uses after the blocks a value computed from the
inputs before them (only the hidden state crosses stages). A refused traced forward is known to
compute something else than the children-order fallback, so it is an error at setup, never a
silently different model; only a forward that calls the whole block container at once
(``self.layers(x)`` on an ``nn.Sequential``) falls back, which computes the same. A forward that
``torch.fx`` cannot trace (data-dependent control flow) falls back to running the top-level
children before and after the blocks in registration order; then a tensor registered on the
model itself, which that fallback never reads, is refused at setup. Both parts run through
``torch.fx.Interpreter`` on the live model, so tensors replaced later (meta to real, a loaded
checkpoint) are read where they are.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import torch
from torch import fx, nn

__all__ = ["ForwardSplit", "split_forward"]


class _LeafTracer(fx.Tracer):
    """Every submodule is a leaf: only the root's own ``forward`` is traced."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:  # noqa: D102
        return True


@dataclasses.dataclass
class ForwardSplit:
    """The model's forward cut at its blocks (see ``[Note: the user's forward, cut at the blocks]``)."""

    embed: Callable | None = None
    """``embed(model, x)``: the forward up to the first block's input (``None`` when refused)."""
    head: Callable | None = None
    """``head(model, x)``: the forward from the last block's output (``None`` when refused)."""
    embed_tensors: frozenset[str] = frozenset()
    """Names of the parameters and buffers that ``embed`` reads."""
    head_tensors: frozenset[str] = frozenset()
    """Names of the parameters and buffers that ``head`` reads."""
    problem: str | None = None
    """Why the forward could not be cut (``None`` when it was)."""
    traced: bool = False
    """Whether ``torch.fx`` traced the forward at all."""
    fatal: bool = False
    """Whether the fallback (top-level children in registration order) is known to compute
    something else than the forward (a value crosses the cut besides the hidden state, or the
    blocks are not run one after another on the hidden state alone)."""
    in_blocks: bool = False
    """Whether the refusal is about how the blocks are run (so ``embed=``/``head=`` cannot fix it:
    the code between blocks belongs inside the block)."""


def _ancestors(nodes: list[fx.Node], stop: set[fx.Node] = frozenset()) -> set[fx.Node]:
    """``nodes`` and everything they are computed from, not walking past ``stop``."""
    seen, todo = set(), list(nodes)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n not in stop:
            todo.extend(n.all_input_nodes)
    return seen


def _tensors_read(nodes: set[fx.Node], model: nn.Module) -> frozenset[str]:
    """Names (each name a tensor is registered under) of the parameters and buffers ``nodes`` read."""
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in model.named_buffers(remove_duplicate=False)]
    read = set()
    for node in nodes:
        if node.op == "get_attr":
            read |= {n for n in names if n == node.target or n.startswith(node.target + ".")}
        elif node.op == "call_module":
            read |= {n for n in names if n.startswith(node.target + ".")}
    return frozenset(read)


class _Part:
    """One part of the cut graph, run on the live model by ``torch.fx.Interpreter``."""

    def __init__(self, graph: fx.Graph, what: str) -> None:
        self.graph, self.what = graph, what

    def __call__(self, model: nn.Module, x: torch.Tensor, extras: dict | None = None):
        return fx.Interpreter(model, graph=self.graph).run(x)

    def __repr__(self) -> str:
        return f"<the model's own forward, {self.what}>"


def _copy(graph: fx.Graph, keep: set[fx.Node], inputs: dict[fx.Node, str], out) -> fx.Graph:
    g, env = fx.Graph(), {}
    for old, name in inputs.items():
        env[old] = g.placeholder(name)
    for n in graph.nodes:
        if n in keep and n not in env:
            env[n] = g.node_copy(n, lambda a: env[a])
    g.output(fx.map_arg(out, lambda a: env[a]))
    g.lint()
    return g


def split_forward(model: nn.Module, blocks_name: str, n_blocks: int) -> ForwardSplit:
    """Cut ``model``'s own forward at its blocks ``blocks_name.0 .. n_blocks-1`` (see
    ``[Note: the user's forward, cut at the blocks]``); never raises: a forward that cannot be cut
    gives a :class:`ForwardSplit` whose ``problem`` says why."""
    sig = inspect.signature(type(model).forward)
    defaults = {
        n: p.default
        for n, p in list(sig.parameters.items())[1:]
        if p.default is not inspect.Parameter.empty and p.kind is not inspect.Parameter.VAR_KEYWORD
    }
    try:
        graph = _LeafTracer().trace(model, concrete_args=defaults or None)
    except Exception as e:  # noqa: BLE001 - any tracing failure means: not traceable, use the fallback
        return ForwardSplit(problem=f"torch.fx cannot trace {type(model).__name__}.forward ({type(e).__name__}: {e})")

    def fail(why: str, fatal: bool = True, in_blocks: bool = True) -> ForwardSplit:
        return ForwardSplit(
            problem=f"{type(model).__name__}.forward {why}", traced=True, fatal=fatal, in_blocks=fatal and in_blocks
        )

    prefix, calls = blocks_name + ".", {}
    for node in graph.nodes:
        if node.op == "call_module" and (node.target == blocks_name or node.target.startswith(prefix)):
            head, _, rest = node.target[len(prefix) :].partition(".")
            if node.target == blocks_name or rest or not head.isdigit():
                return fail(f"calls {node.target} itself, not one block at a time", fatal=node.target != blocks_name)
            if int(head) in calls:
                return fail(f"calls block {node.target} more than once")
            calls[int(head)] = node
    if sorted(calls) != list(range(n_blocks)):
        missing = sorted(set(range(n_blocks)) - set(calls))
        return fail(f"does not call every block of {blocks_name} directly (not called: {missing})", fatal=bool(calls))
    order = list(graph.nodes)
    blocks = [calls[i] for i in range(n_blocks)]
    if [order.index(b) for b in blocks] != sorted(order.index(b) for b in blocks):
        return fail(f"calls the blocks of {blocks_name} out of order")
    for i, b in enumerate(blocks):
        if b.kwargs or len(b.args) != 1 or not isinstance(b.args[0], fx.Node):
            return fail(
                f"calls {b.target} with more than the hidden state ({len(b.args)} args, kwargs {list(b.kwargs)})"
            )
        if i and b.args[0] is not blocks[i - 1]:
            return fail(f"computes {b.target}'s input from more than {blocks[i - 1].target}'s output")
        if i < n_blocks - 1 and len(b.users) != 1:
            return fail(f"uses {b.target}'s output outside the next block")
    first_in, last = blocks[0].args[0], blocks[-1]
    out_node = next(n for n in reversed(order) if n.op == "output")
    embed_nodes = _ancestors([first_in])
    inputs = [n for n in embed_nodes if n.op == "placeholder"]
    if len(inputs) > 1:
        names = sorted(n.target for n in inputs)
        return fail(f"needs {len(inputs)} inputs {names} before the blocks; the first stage gets one", in_blocks=False)
    from_inputs = set()  # nodes computed from the forward's inputs other than through the last block
    for n in order:
        if n.op == "placeholder" or (n is not last and any(a in from_inputs for a in n.all_input_nodes)):
            from_inputs.add(n)
    head_nodes = _ancestors([out_node], stop={last}) - {last, out_node}
    crossing = [n for n in order if n in head_nodes and n in from_inputs and n.op != "output"]
    if crossing:
        return fail(
            f"uses {crossing[0].name!r} after the blocks, a value computed from its inputs rather than from the last "
            "block's output; only the hidden state crosses stages",
            in_blocks=False,
        )
    embed_g = _copy(graph, embed_nodes, {}, first_in)
    head_g = _copy(graph, head_nodes, {last: "x"}, out_node.args[0])
    return ForwardSplit(
        embed=_Part(embed_g, "up to the first block"),
        head=_Part(head_g, "after the last block"),
        embed_tensors=_tensors_read(embed_nodes, model),
        head_tensors=_tensors_read(head_nodes, model),
        traced=True,
    )
