"""The pipeline axis of the hybrid plugin: ``colossal.pipeline`` on the mesh's ``pp`` axis.

``apply_pp`` splits the (already tensor-parallel) model into this rank's stages; the Booster then
drives each step through :meth:`HybridParallelPlugin.execute_pipeline` (``booster.execute_pipeline``),
since no single forward call exists any more. After the pipeline step the gradients are averaged
over ``dp`` (plain data parallelism; ZeRO reduces its own), and clipping takes the norm of the
whole model over ``pp x tp`` (see ``[Note: the global gradient norm under pp]``).

[Note: the global gradient norm under pp]
Each pipeline stage holds different parameters, so the squared norm is summed over the ``pp``
group as well as ``tp``; an element held by ``m`` ranks of that product group (replicated over
``m`` tp ranks, or the tied embedding's two copies on the first and last stage) is weighted by
``m^(-1/p)``, so it counts once. dp replicas hold equal gradients after the average and are not
summed.

[Note: meta construction under pp]
A model built on the meta device (``with torch.device("meta"): GPT(cfg)``, ``build_gpt(...,
lazy=True)``) is never materialised whole: before any axis is applied, each rank allocates the
tensors of its own stages only (``colossal.pipeline.stage_tensor_names``, the split the pipeline
will make) and initialises them with the values a dense build from the same random state gives:
colossalai's models through their ``init_weights`` (a meta parameter is drawn into a scratch
tensor and dropped), any other model through ``reset_parameters()`` of every module in
``modules()`` order, another stage's module on a throw-away copy (``[Note: same initial values
as a dense build]`` in ``colossal.pipeline.stages``). Dense build here means what the Booster does
for a meta model without pp (``materialize()``, or ``to_empty`` + ``reset_parameters``), seeded by
the global random state at ``boost`` time. A Hugging Face model (a built-in policy) is
initialised instead by its own ``_init_weights`` on this rank's modules (``HFPolicy.init_weights``):
the distributions and non-persistent buffers of ``transformers``, not the values of a dense build
(its initialiser walks the whole model in its own order); such a model is usually then loaded
with ``booster.load_pretrained``, each rank reading its stages' tensors. Tensor parallelism
then converts the stage's (dense) modules, so a rank's peak is its stages' dense size plus one
other module or parameter.

[Note: sequence x pipeline parallel]
With ``sp_size > 1`` every rank still passes the whole ``(B, T)`` batch to the pipeline; the
first stage embeds only its ``T/sp`` tokens (global positions through the converted position
embedding), each stage's blocks run ring / all-to-all attention over the ``sp`` group of ranks at
the same stage, and activations and gradients cross stages as ``(b, T/sp, C)``: the receive
shapes are learnt from the first transfer's header (``[Note: shapes agreed once]`` in
``colossal.pipeline.p2p``), so they are the local sequence's. The last stage gathers the logits
over ``sp`` (gradient scaled by ``sp``, ``[Note: sequence-parallel gradients]``) so the user's
criterion sees ``(b, T, V)``; the gradients are then averaged over ``dp x sp`` after the step.
"""

from __future__ import annotations

import torch
from torch import nn

from colossalai.booster.hybrid.shards import multiplicity
from colossalai.booster.hybrid.wrappers import gather_sequence_logits
from colossalai.booster.wrappers import BoostedOptimizer

__all__ = [
    "PipelineModule",
    "pipeline_inputs",
    "PipelineOptimizer",
    "apply_pp",
    "average_over_dp",
    "materialize_stages",
    "pipeline_config",
    "stage_view",
    "SCHEDULES",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
"""Values of ``HybridParallelPlugin(pp_schedule=...)``."""


def _gpt_embed(m: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """The ``colossalai`` GPT's embedding: token + position, dropout ((B, T) -> (B, T, C))."""
    pos = torch.arange(idx.shape[1], device=idx.device)
    return m.drop(m.wte(idx) + m.wpe(pos))


def stage_fns(model: nn.Module, gather=None, sp_group=None):
    """``(embed, head)`` of the first and last stage: the GPT plan when the model has GPT's
    ``wte``/``wpe``/``drop``/``ln_f``/``lm_head``, else ``colossal.pipeline``'s defaults (the children
    before / after the blocks, in order). ``gather`` (tensor parallel) gathers the split logits;
    with ``sp_group`` (sequence parallel) the first stage embeds this rank's ``T/sp`` tokens, so
    every transfer between stages is ``(b, T/sp, C)``, and the last stage gathers the logits over
    the sequence (``[Note: sequence x pipeline parallel]``)."""
    names = {n for n, _ in model.named_children()}
    if not {"wte", "wpe", "drop", "ln_f", "lm_head"} <= names:
        if gather is not None or sp_group is not None:
            raise NotImplementedError(
                "pipeline x tensor / sequence parallel needs the GPT stage plan (wte, wpe, drop, ln_f, lm_head); "
                f"{type(model).__name__} has {sorted(names)}"
            )
        return None, None
    if sp_group is None:
        embed = _gpt_embed
    else:
        from colossal.tensor_parallel import split_sequence

        embed = lambda m, idx: _gpt_embed(m, split_sequence(idx, sp_group))  # noqa: E731  (B, T/sp, C)
    sp_size = torch.distributed.get_world_size(sp_group) if sp_group is not None else 1

    def head(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = m.lm_head(m.ln_f(x))  # (b, T/sp, V/tp) or a 2D/2.5D/3D block of it
        out = gather(out) if gather is not None else out  # (b, T/sp, V)
        return gather_sequence_logits(out, sp_group, sp_size) if sp_group is not None else out  # (b, T, V)

    return embed, head


def pipeline_config(model: nn.Module, *, num_microbatches: int, schedule: str, virtual: int, blocks: str | None = None):
    """The ``colossal.pipeline.PipelineConfig`` of the plugin's pp settings (activation
    checkpointing taken from the model's config; ``blocks``: the block sequence a policy names)."""
    from colossal.pipeline import PipelineConfig

    ckpt = bool(getattr(getattr(model, "config", None), "activation_checkpointing", False))
    return PipelineConfig(
        num_microbatches=num_microbatches, schedule=schedule, virtual=virtual, activation_checkpointing=ckpt,
        blocks=blocks,
    )  # fmt: skip


def materialize_stages(model: nn.Module, mesh, cfg, device: torch.device, policy=None) -> None:
    """Allocate and initialise only this rank's pipeline stages of a meta-device ``model`` (the
    other stages stay meta), with the values of a dense build from the same random state, or (a
    Hugging Face ``policy``) with the model's own initialiser (``[Note: meta construction under
    pp]``). Communicates nothing."""
    from colossal.pipeline import check_initialised, materialize_owned, stage_tensor_names

    owned = stage_tensor_names(model, cfg, mesh.axes["pp"], mesh.coordinate("pp"))
    if policy is not None:  # transformers' _init_weights per real module
        materialize_owned(model, owned, device, lambda m: None, check=False)
        policy.init_weights(model)
        check_initialised(model, owned)
        return
    whole_model_init = callable(getattr(model, "init_weights", None)) and hasattr(model, "materialize")
    materialize_owned(model, owned, device, (lambda m: None) if whole_model_init else None, check=not whole_model_init)
    if whole_model_init:  # colossalai's GPT / PaLM: their own initialiser skips meta tensors
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        model.init_weights()
        check_initialised(model, owned)


def apply_pp(model: nn.Module, mesh, cfg, *, gather, sp, device, policy=None):
    """Split ``model`` over the mesh's ``pp`` axis; returns the ``colossal.pipeline.PipelineParallel``.
    ``gather``: the tensor-parallel logits gather (or ``None``); ``sp``: the sequence group (or ``None``);
    ``policy``: a Hugging Face policy, whose stages run the model's own forward cut at the blocks
    (``[Note: a Hugging Face model cut into pipeline stages]`` in :mod:`colossalai.policies.hf_pipeline`)."""
    from colossal.pipeline import PipelineParallel

    if getattr(policy, "pp_blocks", None) is not None:
        embed, head, call = policy.stage_fns(model, device)  # its logits are whole: no gather
        return PipelineParallel(model, cfg, mesh.group("pp"), embed=embed, head=head, device=device, block_call=call)
    embed, head = stage_fns(model, gather, sp)
    return PipelineParallel(model, cfg, mesh.group("pp"), embed=embed, head=head, device=device)


def pipeline_inputs(x, keys: tuple[str, tuple[str, ...]] | None):
    """``(inputs, extras)`` of a pipeline batch's ``x``: a tensor, or (a Hugging Face model,
    ``keys = (first, extra_keys)`` given) a dict of ``first`` (``input_ids``, ``pixel_values``) plus
    any of ``extra_keys`` (``attention_mask``, ``position_ids``, ...), each shaped like ``first``.
    ``extras`` is ``None`` for a model without extra inputs. Raises ``TypeError`` / ``ValueError``
    naming what is wrong, before any transfer."""
    if keys is None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"this pipeline takes a tensor of inputs (the batch's x), got {type(x).__name__}; a dict of "
                "input_ids and attention_mask is for Hugging Face models with a pipeline policy"
            )
        return x, None
    first, extra_keys = keys
    if isinstance(x, torch.Tensor):
        return x, {}
    if not isinstance(x, dict) or first not in x:
        got = sorted(x) if isinstance(x, dict) else type(x).__name__
        raise TypeError(f"this Hugging Face pipeline's x is {first} or a dict with {first!r}, got {got}")
    unknown = sorted(set(x) - {first, *extra_keys})
    if unknown:
        raise ValueError(f"pipeline inputs {unknown} are not supported; x may hold {first} and {list(extra_keys)}")
    extras = {k: v for k, v in x.items() if k != first and v is not None}
    shape = lambda v: tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__  # noqa: E731
    bad = {k: shape(v) for k, v in extras.items() if shape(v) != shape(x[first])}
    if bad:
        raise ValueError(f"{sorted(bad)} must have the shape of {first} {shape(x[first])}, got {bad}")
    return x[first], extras


class PipelineModule(nn.Module):
    """This rank's stages of the user's model; run steps with ``booster.execute_pipeline``."""

    def __init__(self, module: nn.Module, pipe) -> None:
        super().__init__()
        self.module = module
        self.__dict__["pipe"] = pipe  # not a submodule

    def forward(self, *args, **kwargs):
        """Not available under pipeline parallelism (no rank holds the whole forward)."""
        raise RuntimeError(
            "a pipeline-parallel model has no single forward: use booster.execute_pipeline((x, y), model, "
            "criterion, optimizer), which runs forward and backward of all micro-batches"
        )


def replicas_over_pp_tp(pipe, dense_shapes: dict[str, torch.Size], tp_size: int, prefix: str = "") -> dict[int, int]:
    """parameter id -> ranks of the pp x tp group holding each of its elements (``prefix``: what the
    pipeline's parameter names lack of ``dense_shapes``' names, a peft model's base prefix)."""
    named = dict(pipe.named_parameters())
    tied = {id(named[n]) for n in pipe.tied_names}
    return {
        id(p): multiplicity(p, dense_shapes[prefix + n], tp_size) * (2 if id(p) in tied else 1)
        for n, p in pipe.named_parameters()
    }


def stage_view(model: nn.Module) -> nn.Module:
    """A module tree holding only this rank's real parameters under their original names (the
    other stages' are meta): what a ZeRO engine over dp shards. Ties stay ties."""
    root = nn.Module()
    for name, p in model.named_parameters():  # first names of tied ones
        if p.is_meta:
            continue
        *path, attr = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(attr, p)
    return root


@torch.no_grad()
def average_over_dp(params: list[nn.Parameter], group) -> None:
    """Average the gradients over the data-parallel ``group`` in one flat all-reduce."""
    from colossal.comm import all_reduce

    grads = [p.grad for p in params if p.grad is not None]
    if not grads or torch.distributed.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce(flat, "avg", group, tag="hybrid.pp.dp_grad")
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


class PipelineOptimizer(BoostedOptimizer):
    """Clips by the norm of the whole model's gradients over ``pp x tp`` (``[Note: the global
    gradient norm under pp]``). With a loss ``scaler`` (fp16) the overflow check is agreed over
    ``pp x tp`` (dp replicas hold equal, averaged gradients): an inf on any stage or tp block
    skips the step, and backs the scale off, on every rank."""

    def __init__(self, optimizer, replicas: dict[int, int], group, scaler=None) -> None:
        super().__init__(optimizer, scaler)
        self.replicas, self.norm_group = replicas, group

    def step(self, *args, **kwargs) -> None:
        """Unscale, then step unless a gradient overflowed on any rank of ``pp x tp`` (fp16)."""
        if self.scaler is None:
            return super().step(*args, **kwargs)
        import functools

        from colossal.comm import all_reduce
        from colossal.optim import has_inf_or_nan

        self._unscale()
        reduce = functools.partial(all_reduce, tag="hybrid.pp.overflow")
        found_inf = has_inf_or_nan(self._grads(), self.norm_group, all_reduce=reduce)
        self.scaler.update(found_inf)
        self.last_step_skipped = found_inf
        if not found_inf:
            self.optim.step(*args, **kwargs)
        self._unscaled = False

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Total norm of the dense gradients (the same on every rank), clipped in place."""
        from colossal.optim import grad_norm

        self._unscale()
        p = float(norm_type)
        grads = []
        for param in self.params:
            if param.grad is None:
                continue
            m = self.replicas.get(id(param), 1)
            grads.append(param.grad if m == 1 or p == float("inf") else param.grad * m ** (-1.0 / p))
        total = grad_norm(grads, p, group=self.norm_group)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for param in self.params:
            if param.grad is not None:
                param.grad.mul_(coef.to(param.grad.device))
        return total
