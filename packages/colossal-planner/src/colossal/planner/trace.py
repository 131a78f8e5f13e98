"""One training step of a model, run on the meta device: what every layout's prediction is made of.

:func:`trace_model` builds the model on the ``meta`` device (no weights are allocated), runs one
forward, the loss and one backward on a meta batch, and records, per dispatched operator:

* the **live bytes** of every tensor that is not a parameter and not a gradient (activations,
  saved tensors, temporaries, the incoming gradient of each parameter before it is accumulated),
  the peak within the operator included: the meta allocator frees exactly when the CPU and CUDA
  allocators would (reference counts), so this is the non-model data of the real step;
* the operator's FLOPs (torch's own ``torch.utils.flop_counter`` formulas) and the bytes it reads
  and writes (the roofline's two terms);
* where each parameter's gradient is produced, and where each module's forward and backward
  start and end (what the engines' gather/free and bucket rules are applied to).

[Note: data-dependent branches]
A meta tensor has no values, so ``.item()`` / ``bool(t)`` inside the model cannot be answered from
data. The trace answers ``True`` for a boolean and 0 for a number: the common path of the checks
models make on their inputs (Hugging Face's test for packed sequences, "all positions
consecutive", is true for an ordinary batch). A model whose memory depends on its data (MoE token
routing, say) is traced as if every such check took that path.

[Note: what tensor parallelism splits]
Megatron-style 1D tensor parallelism (``colossal.tensor_parallel``'s COL / ROW / HEADS styles)
splits, inside each block, every tensor between a column-parallel and a row-parallel matmul (the
attention heads, the MLP's inner width) and keeps every tensor of the hidden width whole (norms,
residuals, the row matmul's all-reduced output). The trace classifies each tensor made inside a
block by that rule: a matmul with a weight is a column matmul when its activation input is
whole (its output is split) and a row matmul when that input is split (its output, all-reduced,
is whole), in backward as in forward; any other operator's output (attention, element-wise, a
matmul of two activations) is split when one of its inputs is. Outside the blocks (embedding,
head, loss) nothing is split: the plugins gather the logits for the user's criterion. 2D/2.5D/3D
partition every activation of a block (:attr:`ModelTrace.live_block`).

[Note: what the trace is and is not]
The trace is the plain single-process step. Engines change the model-state side only (where
parameters, gradients and optimizer states live, and what is gathered when); the activation side
is the model's own and is the same under every layout of the same micro-batch, precision and
checkpointing. Tensor, sequence and pipeline parallelism change the activation side too: the trace records
which tensors tensor parallelism splits and which operators each block runs, and
:mod:`colossal.planner.hybrid` derives one rank's step from them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["ParamInfo", "ModelTrace", "trace_model", "lm_loss"]


@dataclasses.dataclass(frozen=True, slots=True)
class ParamInfo:
    """One parameter of the traced model (shared parameters appear once, under their first name)."""

    name: str
    """Its name in ``named_parameters()`` (the first one, for a tied parameter)."""
    numel: int
    """Number of elements."""
    dtype: torch.dtype
    """Its dtype as built by the factory (the layouts apply their own working precision)."""
    requires_grad: bool
    """False for a frozen parameter: no gradient and no optimizer state in any engine."""
    unit: int
    """Index in :attr:`ModelTrace.units` of the innermost ZeRO-3 unit owning it (0 = the root)."""
    shape: tuple[int, ...] = ()
    """Its shape."""
    tied: bool = False
    """Whether more than one module holds it (a tied embedding and LM head)."""
    first_use: int = -1
    """The first forward operator that reads it (-1: never read in the forward)."""
    split_use: bool = False
    """Whether that operator's output is split by 1D tensor parallelism (a column layer's bias; a
    weight's first reader is its transpose view; see [Note: what tensor parallelism splits])."""

    @property
    def nbytes(self) -> int:
        """Bytes in its own dtype."""
        return self.numel * self.dtype.itemsize


@dataclasses.dataclass(frozen=True, slots=True)
class ModelTrace:
    """What one traced training step of a model costs, independent of the layout."""

    params: tuple[ParamInfo, ...]
    """Unique parameters in registration order."""
    buffer_bytes: int
    """Bytes of the model's buffers."""
    batch: int
    """Sequences in the traced micro-batch."""
    seq: int
    """Tokens per sequence."""
    dtype: torch.dtype
    """Dtype the model was traced in (its activations have it)."""
    activation_checkpointing: bool
    """Whether the model recomputed its blocks in backward."""
    live: tuple[int, ...]
    """Per operator: peak live non-model bytes while it ran (see the module docstring)."""
    flops: tuple[float, ...]
    """Per operator: FLOPs (0 for operators without a formula: element-wise work is counted in bytes)."""
    io_bytes: tuple[int, ...]
    """Per operator: bytes of its tensor inputs and outputs."""
    attention: tuple[bool, ...]
    """Per operator: whether it is a fused attention kernel (forward or backward), whose achieved
    FLOP/s differ from a matmul's (on a CPU, bf16 flash attention's backward most of all)."""
    backward_start: int
    """Index of the first operator of the backward pass (forward = operators before it)."""
    grad_op: tuple[int, ...]
    """Per parameter: the operator that produced its gradient (-1: the parameter got none)."""
    units: tuple[str, ...]
    """Module paths of the ZeRO-3 units (root first, then each child of an ``nn.ModuleList``)."""
    unit_forward: tuple[tuple[int, int], ...]
    """Per unit: (first, last) operator of its forward (the root spans the whole forward)."""
    unit_backward: tuple[int, ...]
    """Per unit: the operator at which its backward starts (root: ``backward_start``)."""
    tokens: int
    """Tokens in the traced micro-batch (``batch * seq``)."""
    input_bytes: int = 0
    """Bytes of the micro-batch's input tensors."""
    hidden: int = 0
    """The model's hidden width (its config's ``hidden_size`` / ``n_embd`` / ``d_model``, else the
    most common size of a 1-D parameter); 0 when unknown."""
    heads: int = 0
    """Attention heads of the config (``num_attention_heads`` / ``n_head``); 0 when unknown."""
    experts: int = 0
    """Experts per MoE layer (the largest index under an ``experts`` module list, plus one, or the
    leading dimension of stacked expert weights under ``experts.``); 0: dense."""
    vocab: int = 0
    """The vocabulary size (the config's ``vocab_size`` or the ``vocab_size=`` given); 0 when unknown."""
    blocks: tuple[int, ...] = ()
    """Indices in :attr:`units` of the model's blocks: the children of its outermost
    ``nn.ModuleList`` (what pipeline parallelism cuts into stages)."""
    live_split: tuple[int, ...] = ()
    """Per operator: the part of :attr:`live` that 1D tensor parallelism splits (see
    [Note: what tensor parallelism splits])."""
    live_block: tuple[int, ...] = ()
    """Per operator: the part of :attr:`live` allocated inside the blocks (what 2D/2.5D/3D tensor
    parallelism partitions)."""
    split: tuple[bool, ...] = ()
    """Per operator: whether 1D tensor parallelism splits its work (inside a block, on a split tensor)."""
    in_block: tuple[bool, ...] = ()
    """Per operator: whether it runs inside one of :attr:`blocks` (forward, recomputation or backward)."""
    reduce_bytes: tuple[int, ...] = ()
    """Per operator: bytes 1D tensor parallelism all-reduces after it (a row matmul's output in
    forward, a column matmul's input gradient in backward), else 0."""

    @property
    def ops(self) -> int:
        """Operators dispatched by one step (forward, loss and backward)."""
        return len(self.live)

    @property
    def numel(self) -> int:
        """Elements of all parameters."""
        return sum(p.numel for p in self.params)

    @property
    def trainable_numel(self) -> int:
        """Elements of the parameters that get gradients."""
        return sum(p.numel for p in self.params if p.requires_grad)

    @property
    def activation_peak(self) -> int:
        """Peak non-model bytes of the plain step (activations, temporaries, incoming gradients)."""
        return max(self.live, default=0)

    @property
    def saved_bytes(self) -> int:
        """Non-model bytes live when the backward starts (what the forward saved for it)."""
        return self.live[self.backward_start - 1] if self.backward_start > 0 else 0

    @property
    def forward_flops(self) -> float:
        """FLOPs of the forward (and loss)."""
        return sum(self.flops[: self.backward_start])

    @property
    def total_flops(self) -> float:
        """FLOPs of forward + backward (+ recomputation under activation checkpointing)."""
        return sum(self.flops)


def lm_loss(output: Any, idx: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of a causal LM's logits (a tensor, or an object with ``.logits``)."""
    logits = output.logits if hasattr(output, "logits") else output
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"the model returned {type(output).__name__}; give trace_model a loss= function")
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), idx.reshape(-1))


@contextlib.contextmanager
def _fused_attention(device_type: str):
    """``scaled_dot_product_attention`` as the target device runs it, for the trace's duration.

    On the meta device torch takes the math path, which materialises the (T, T) attention matrix
    and saves it for backward; CPU and CUDA run a fused (flash) kernel that saves only the output
    and the log-sum-exp. The fused kernels have meta formulas, so the trace calls them directly.
    The function is patched on ``torch.nn.functional`` (a function mode would not see the
    recomputation that activation checkpointing runs inside backward).
    """
    original = nn.functional.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or q.dim() != 4 or q.shape[-1] != v.shape[-1]:
            # outside the fused kernels' conditions torch takes the math path on every device
            return original(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if enable_gqa and k.shape[1] != q.shape[1]:  # grouped-query attention: the kernels see repeated heads
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        if device_type == "cuda":
            out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)
        else:
            out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, scale=scale)
        return out[0]

    nn.functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        nn.functional.scaled_dot_product_attention = original


_MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm,
            torch.ops.aten.linear, torch.ops.aten.matmul}  # fmt: skip

_META_SCALARS = {torch.bool: True, torch.float32: 0.0, torch.float16: 0.0, torch.bfloat16: 0.0, torch.float64: 0.0}
"""What ``.item()`` of a meta tensor returns in a trace (see [Note: data-dependent branches])."""


class _Recorder(TorchDispatchMode):
    """Counts live tensor storages (by weak reference) and per-operator FLOPs and bytes."""

    def __init__(self, exclude: set[int], params: dict[int, int]) -> None:
        super().__init__()
        self.exclude = exclude  # storages of parameters and buffers (model data, not traced)
        self.params = params  # parameter storage -> its index (first use in the forward)
        self.first_use: dict[int, int] = {}
        self.first_split: dict[int, bool] = {}  # whether the first operator reading it splits its output
        self.reduce_bytes: list[int] = []
        self.depth = 0  # > 0 inside a block (its hooks count)
        self.forward = True
        self.split_keys: set[int] = set()
        self.block_keys: set[int] = set()
        self.cur_split = self.cur_block = 0
        self.live_split: list[int] = []
        self.live_block: list[int] = []
        self.op_split: list[bool] = []
        self.op_block: list[bool] = []
        self.sizes: dict[int, int] = {}
        self.alloc_op: dict[int, int] = {}
        self.cur = 0
        self.live: list[int] = []
        self.flops: list[float] = []
        self.io: list[int] = []
        self.attention: list[bool] = []  # fused attention kernels: their own rate (Hardware.attention_rate)

    def _free(self, key: int) -> None:
        n = self.sizes.pop(key)
        self.cur -= n
        if key in self.split_keys:
            self.split_keys.discard(key)
            self.cur_split -= n
        if key in self.block_keys:
            self.block_keys.discard(key)
            self.cur_block -= n

    def _track(self, t: torch.Tensor, split: bool) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.sizes or key in self.exclude:
            return
        n = storage.nbytes()
        self.sizes[key] = n
        self.alloc_op[key] = len(self.live)
        self.cur += n
        if self.depth > 0:
            self.block_keys.add(key)
            self.cur_block += n
            if split:
                self.split_keys.add(key)
                self.cur_split += n
        weakref.finalize(storage, self._free, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            # [Note: data-dependent branches] a meta tensor has no value; the model's own checks on
            # its inputs (Hugging Face's "are these packed sequences?") take the common path
            return _META_SCALARS.get(args[0].dtype, 0)
        before, before_split, before_block = self.cur, self.cur_split, self.cur_block
        out = func(*args, **kwargs)
        flat_in = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        flat_out = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        packet = func._overloadpacket
        used = [i for t in flat_in if (i := self.params.get(t.untyped_storage()._cdata)) is not None]
        split_in = self.depth > 0 and any(t.untyped_storage()._cdata in self.split_keys for t in flat_in)
        if self.depth > 0 and packet in _MATMULS and used:
            split = not split_in  # a column matmul splits, a row matmul's all-reduced output is whole
        else:
            split = split_in
        # a row matmul's output is all-reduced over the tensor-parallel group (forward, and the
        # column matmul's input gradient in backward)
        reduced = self.depth > 0 and packet in _MATMULS and bool(used) and split_in and not split
        self.reduce_bytes.append(sum(t.numel() * t.element_size() for t in flat_out) if reduced else 0)
        if self.forward:
            for i in used:
                if i not in self.first_use:
                    self.first_use[i] = len(self.live)
                    self.first_split[i] = split
        for t in flat_out:
            self._track(t, split)
        self.op_split.append(self.depth > 0 and (split or split_in))
        self.op_block.append(self.depth > 0)
        self.live_split.append(max(before_split, self.cur_split))
        self.live_block.append(max(before_block, self.cur_block))
        counter = flop_registry.get(packet)
        if packet is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:  # not in torch's registry
            flops = float(sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape))
        elif packet is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
            flops = float(sdpa_backward_flop_count(args[0].shape, args[1].shape, args[2].shape, args[3].shape))
        else:
            flops = float(counter(*args, **kwargs, out_val=out)) if counter is not None else 0.0
        self.flops.append(flops)
        self.attention.append("attention" in packet.__name__)
        ins = {t.untyped_storage()._cdata for t in flat_in}
        view = bool(flat_out) and not packet.__name__.endswith("_") and all(
            t.untyped_storage()._cdata in ins for t in flat_out)  # fmt: skip
        # a view (t, transpose, reshape of a contiguous tensor, detach) moves no bytes
        self.io.append(0 if view else sum(t.numel() * t.element_size() for t in flat_in + flat_out))
        self.live.append(max(before, self.cur))
        return out


def _units(model: nn.Module) -> tuple[list[str], list[nn.Module], dict[nn.Parameter, int]]:
    """ZeRO-3's default units (``colossal.zero``'s rule: the root, then every child of an
    ``nn.ModuleList``) and the innermost unit enclosing every module that uses each parameter."""
    picked = {id(c) for m in model.modules() if isinstance(m, nn.ModuleList) for c in m.children()}
    names = [""] + [n for n, m in model.named_modules() if id(m) in picked and m is not model]
    mods = [model] + [m for m in model.modules() if id(m) in picked and m is not model]
    index = {id(m): i for i, m in enumerate(mods)}
    owner: dict[nn.Parameter, set[int]] = {}

    def walk(module: nn.Module, cur: int) -> None:
        cur = index.get(id(module), cur)
        for p in module.parameters(recurse=False):
            owner.setdefault(p, set()).add(cur)
        for child in module.children():
            walk(child, cur)

    walk(model, 0)
    unit_of = {p: (next(iter(us)) if len(us) == 1 else 0) for p, us in owner.items()}
    return names, mods, unit_of


def trace_model(
    factory: Callable[[], nn.Module],
    *,
    batch: int,
    seq: int,
    dtype: torch.dtype = torch.float32,
    activation_checkpointing: bool = False,
    inputs: Callable[[int, int], tuple] | None = None,
    loss: Callable[..., torch.Tensor] | None = None,
    vocab_size: int | None = None,
    device_type: str = "cpu",
) -> ModelTrace:
    """Trace one training step of ``factory()`` on the meta device.

    ``factory`` is called under ``torch.device("meta")`` (a factory that builds on another device
    explicitly still gets moved to meta, with its weights dropped). ``inputs(batch, seq)`` makes the
    positional inputs (run under ``torch.device("meta")``; default: token ids of shape
    ``(batch, seq)`` below ``vocab_size``, or the model's ``config.vocab_size``);
    ``loss(output, *inputs)`` the scalar loss (default: :func:`lm_loss`). ``dtype`` is the working
    precision the activations have (the model is cast to it); ``activation_checkpointing`` calls
    the model's ``set_activation_checkpointing(True)`` or ``gradient_checkpointing_enable()``.
    ``device_type`` (``"cpu"`` or ``"cuda"``) is the device the step will run on: attention is
    traced with that device's fused kernel.
    """
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    for name, value in (("batch", batch), ("seq", seq)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"the model factory returned {type(model).__name__}, not an nn.Module")
    model = model.to(device="meta", dtype=dtype) if dtype.is_floating_point else model.to("meta")
    if activation_checkpointing:
        if hasattr(model, "set_activation_checkpointing"):
            model.set_activation_checkpointing(True)
        elif hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable()
        else:
            raise ValueError(
                f"activation_checkpointing=True, but {type(model).__name__} has neither "
                "set_activation_checkpointing() nor gradient_checkpointing_enable()"
            )
    model.train()
    if inputs is None:
        vocab = vocab_size or getattr(getattr(model, "config", None), "vocab_size", None)
        if vocab is None:
            raise ValueError(f"cannot make token ids for {type(model).__name__}: give vocab_size= or inputs=")
        args: tuple = (torch.zeros(batch, seq, dtype=torch.long, device="meta"),)
    else:
        with torch.device("meta"):  # tensors the callback makes land on the meta device (no memory)
            args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in inputs(batch, seq))
    loss_fn = loss or lm_loss

    seen: set[int] = set()
    params: list[tuple[str, nn.Parameter]] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            params.append((name, p))
    exclude = {p.untyped_storage()._cdata for _, p in params} | {b.untyped_storage()._cdata for b in model.buffers()}
    unit_names, unit_mods, unit_of = _units(model)
    hidden = _config_int(model, "hidden_size", "n_embd", "d_model")
    if not hidden:  # the most common size of a 1-D parameter (norms, biases of the hidden width)
        sizes = [p.numel() for _, p in params if p.dim() == 1]
        hidden = max(set(sizes), key=sizes.count) if sizes else 0
    blocks = [i for i, n in enumerate(unit_names) if i and not any(
        o and n.startswith(o + ".") for o in unit_names[1:i])]  # fmt: skip
    rec = _Recorder(exclude, {p.untyped_storage()._cdata: i for i, (_, p) in enumerate(params)})
    forward: dict[int, list[int]] = {}
    backward: dict[int, int] = {}
    hooks = []

    def on_forward_start(i: int) -> None:
        forward.setdefault(i, [len(rec.live), -1])

    def on_forward_end(i: int) -> None:
        forward[i][1] = len(rec.live)

    def on_backward_start(i: int) -> None:
        backward.setdefault(i, len(rec.live))

    for i, mod in enumerate(unit_mods):  # hooks must return None: a value would replace the inputs
        hooks.append(mod.register_forward_pre_hook(lambda *_, i=i: on_forward_start(i)))
        hooks.append(mod.register_forward_hook(lambda *_, i=i: on_forward_end(i)))
        hooks.append(mod.register_full_backward_pre_hook(lambda *_, i=i: on_backward_start(i)))
    for i in blocks:  # rec.depth > 0 inside a block, forward (and recomputation) and backward
        hooks.append(unit_mods[i].register_forward_pre_hook(lambda *_: _enter(rec)))
        hooks.append(unit_mods[i].register_forward_hook(lambda *_: _leave(rec)))
        hooks.append(unit_mods[i].register_full_backward_pre_hook(lambda *_: _enter(rec)))
        hooks.append(unit_mods[i].register_full_backward_hook(lambda *_: _leave(rec)))
    try:
        with _fused_attention(device_type), rec, warnings.catch_warnings():
            # the root's backward hook cannot see through a model output object (Hugging Face's):
            # its backward start is then the loss's, which is what it is
            warnings.filterwarnings("ignore", message="For backward hooks to be called")
            out = model(*args)
            value = loss_fn(out, *args)
            del out
            start = len(rec.live)
            rec.forward = False
            with warnings.catch_warnings():  # a unit whose inputs need no gradient (the embedding's)
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                value.backward()
            del value
    finally:
        for h in hooks:
            h.remove()
    grad_keys = {}
    for i, (_, p) in enumerate(params):
        if p.grad is not None:
            grad_keys[p.grad.untyped_storage()._cdata] = i
    grad_op = [-1] * len(params)
    for key, i in grad_keys.items():
        grad_op[i] = rec.alloc_op.get(key, start)
    # Gradients are model data: their bytes leave the live series from the operator that made them
    # (each engine puts them back by its own rule; plain PyTorch keeps each one to the step).
    series = (list(rec.live), list(rec.live_split), list(rec.live_block))
    for n, keys in enumerate((None, rec.split_keys, rec.block_keys)):  # gradients are live to the end
        live = series[n]
        drop = [0] * (len(live) + 1)
        for key, i in grad_keys.items():
            if key in rec.alloc_op and (keys is None or key in keys):
                drop[rec.alloc_op[key]] += params[i][1].numel() * params[i][1].element_size()
        acc = 0
        for j in range(len(live)):
            acc += drop[j]
            # the operator that produced a gradient still held it as an incoming tensor: count it there
            live[j] -= acc - drop[j]
    live = series[0]
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    infos = tuple(
        ParamInfo(
            name,
            p.numel(),
            p.dtype,
            p.requires_grad,
            unit_of.get(p, 0),
            tuple(p.shape),
            uses[id(p)] > 1,
            rec.first_use.get(i, -1),
            rec.first_split.get(i, False),
        )  # fmt: skip
        for i, (name, p) in enumerate(params)
    )
    experts = [int(m.group(1)) for name, _ in params if (m := re.search(r"(?:^|\.)experts\.(\d+)\.", name))]
    experts += [p.shape[0] - 1 for name, p in params if re.search(r"(?:^|\.)experts\.[^.\d]", name) and p.dim() == 3]
    return ModelTrace(
        params=infos,
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        batch=batch,
        seq=seq,
        dtype=dtype,
        activation_checkpointing=activation_checkpointing,
        live=tuple(live),
        flops=tuple(rec.flops),
        io_bytes=tuple(rec.io),
        attention=tuple(rec.attention),
        backward_start=start,
        grad_op=tuple(grad_op),
        units=tuple(unit_names),
        unit_forward=tuple(tuple(forward.get(i, [0, start])) for i in range(len(unit_mods))),
        unit_backward=tuple(backward.get(i, start) for i in range(len(unit_mods))),
        tokens=batch * seq,
        input_bytes=sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor)),
        hidden=hidden,
        heads=_config_int(model, "num_attention_heads", "n_head", "num_heads"),
        experts=max(experts) + 1 if experts else 0,
        vocab=vocab_size or _config_int(model, "vocab_size"),
        blocks=tuple(blocks),
        live_split=tuple(series[1]),
        live_block=tuple(series[2]),
        split=tuple(rec.op_split),
        in_block=tuple(rec.op_block),
        reduce_bytes=tuple(rec.reduce_bytes),
    )


def _config_int(model: nn.Module, *names: str) -> int:
    """The first of ``names`` that ``model.config`` (or the model) has as a positive int, else 0."""
    for owner in (getattr(model, "config", None), model):
        for name in names:
            v = getattr(owner, name, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return 0


def _enter(rec: _Recorder) -> None:
    rec.depth += 1


def _leave(rec: _Recorder) -> None:
    rec.depth = max(0, rec.depth - 1)
