"""Hybrid parallelism: data x pipeline x tensor (1D/2D/2.5D/3D) x sequence parallel, through
``colossal.tensor_parallel`` and ``colossal.pipeline`` on a ``colossal.comm.Mesh``.

Layouts: ``Mesh(axes={"dp": world // tp_size, "tp": tp_size})`` for tensor parallelism,
``Mesh(axes={"dp": world // sp_size, "sp": sp_size})`` for sequence parallelism, and
``Mesh(axes={"dp": ..., "sp": sp_size, "tp": tp_size})`` for both (tp innermost, the most
talkative axis); with ``pp_size > 1`` a ``pp`` axis goes outermost:
``Mesh(axes={"pp": pp_size, "dp": ..., "tp": tp_size})``. The model is converted in place by
``colossal.tensor_parallel`` (``gpt_plan(mode)`` by default), its split logits are gathered so
that the user's criterion runs unchanged on the full ``(B, T, V)`` logits, and gradients are
averaged over ``dp`` (times ``sp``) by DDP.

[Note: the order of the axes]
``configure`` applies the axes in one order: materialise (under pp only this rank's stages,
``[Note: meta construction under pp]`` in :mod:`.pp`), tensor parallel (:mod:`.tp` layers
convert the dense modules), sequence parallel (wraps the converted model), expert parallel
(:mod:`.ep` swaps each MoE layer for this rank's experts, before the pipeline captures its stages'
parameters and before the optimizer is rebound by name), pipeline parallel (:mod:`.pp` cuts the
converted model into this rank's stages, so tp layers are split whole), then data parallel last
(DDP or ZeRO wrap exactly the parameters this rank keeps; with ep, ZeRO is two engines,
:mod:`.ep_zero`).

[Note: tensor-parallel state in checkpoints]
A 1D-parallel parameter is an even split, in rank order, of the dense parameter along one
dimension, i.e. exactly a ``DTensor`` with ``Shard(dim)`` on the ``tp`` sub-mesh. 1D state dicts
are therefore handed to DCP as DTensors (dimension found by comparing with the dense shapes
recorded before conversion). 2D/2.5D/3D blocks are not one-dimensional splits: their state is
gathered to the dense tensors over the tp group on save and re-split on load
(:class:`~colossalai.booster.hybrid.shards.ShardIndex`). Either way the checkpoint holds the
original names and full logical shapes, so it loads into any other plugin or layout.

See ``[Note: sequence-parallel gradients]`` in :mod:`colossalai.booster.hybrid.wrappers`.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

from colossalai.booster.ddp_plugin import materialize_
from colossalai.booster.hybrid.adapters import base_prefix, check_frozen_experts, check_lora_layout, lora_base
from colossalai.booster.hybrid.dp import apply_ddp, dp_group
from colossalai.booster.hybrid.ep import (
    ExpertParallel,
    ExpertParallelOptimizer,
    ExpertPipelineOptimizer,
    apply_expert_parallel,
    check_ep,
    expert_free_replicas,
    expert_layers,
)
from colossalai.booster.hybrid.ep_zero import ExpertZeroOptimizer
from colossalai.booster.hybrid.plans import check_user_plan, model_plan
from colossalai.booster.hybrid.pp import (
    SCHEDULES,
    PipelineModule,
    PipelineOptimizer,
    apply_pp,
    average_over_dp,
    materialize_stages,
    pipeline_config,
    pipeline_inputs,
    replicas_over_pp_tp,
    stage_view,
)
from colossalai.booster.hybrid.shards import ShardIndex, TensorParallelOptimizer, multiplicity
from colossalai.booster.hybrid.sp import apply_sp
from colossalai.booster.hybrid.tp import apply_tp
from colossalai.booster.hybrid.wrappers import (
    SP_KINDS,
    TP_MODES,
    GatherLogits,
    SequenceParallel,
    check_layout,
)
from colossalai.booster.hybrid.zero import HybridZeroOptimizer, zero_engine
from colossalai.booster.lora import is_peft_model
from colossalai.booster.plugin import Plugin, ensure_process_group, param_names, rebind_optimizer, world_size
from colossalai.booster.precision import Precision
from colossalai.booster.zero_plugin import load_zero_optimizer, zero_optimizer_state
from colossalai.checkpoint.slices import aliases, model_entries

__all__ = ["HybridParallelPlugin", "TensorParallelOptimizer"]

ZERO_STAGES = (0, 1, 2)
"""ZeRO stages the hybrid plugin supports (0 = DDP)."""


def _fp16_scaler():
    from colossal.optim import DynamicLossScaler

    return DynamicLossScaler()


class HybridParallelPlugin(Plugin):
    """``HybridParallelPlugin(tp_size=4, tp_mode="2d")``: tensor parallel inside groups of
    ``tp_size`` ranks (``tp_mode`` 1d, 2d, 2.5d with ``tp_depth``, 3d), data parallel across them;
    ``HybridParallelPlugin(tp_size=1, sp_size=2)``: sequence parallel (``sp_kind`` ring or
    all_to_all attention) inside groups of ``sp_size`` ranks, data parallel across them;
    ``HybridParallelPlugin(tp_size=2, sp_size=2)``: both (any ``tp_mode`` inside each sequence
    chunk), data parallel across ``tp_size * sp_size`` ranks.
    ``HybridParallelPlugin(pp_size=2, num_microbatches=4, pp_schedule="1f1b", tp_size=2)``:
    pipeline parallel over ``pp_size`` stages (``colossal.pipeline``; ``pp_schedule`` gpipe, 1f1b,
    interleaved with ``pp_virtual`` chunks per rank, zero_bubble), composed with tp (any mode), sp and
    dp; steps run through ``booster.execute_pipeline``.
    ``zero_stage`` 1 or 2 shards optimizer states (and gradients) over the dp (x sp) group with
    ``colossal.zero`` instead of DDP. Precision: fp32, bf16, and fp16 with a
    ``colossal.optim.DynamicLossScaler`` whose overflow check is agreed over the tp (or sp) group.
    ``HybridParallelPlugin(tp_size=1, ep_size=2)`` (or ``tp_size=2``, 1D): expert parallelism for a model with
    ``colossal.moe.MoE`` layers (e.g. ``build_moe_gpt``) or a Hugging Face Mixtral (its
    sparse-MoE blocks keep Mixtral's routing; :mod:`colossalai.policies.hf_moe`): the dp axis is split into ``edp x ep``
    (``ep`` consecutive ranks share out each layer's experts; ``[Note: expert parallelism in the
    hybrid plugin]`` in :mod:`colossalai.booster.hybrid.ep`), dense parameters reduce over dp with
    DDP, expert gradients over ``edp`` before ``step``; checkpoints hold every expert under its
    dense name. With ``zero_stage`` 1/2 dense states shard over dp and expert states over ``edp``
    (:mod:`colossalai.booster.hybrid.ep_zero`); with ``pp_size > 1`` the MoE aux losses are added
    per stage (``[Note: MoE auxiliary losses]`` in :mod:`colossalai.booster.booster`).
    With ``sp_size > 1`` a Mixtral's experts split over the ``dp x sp`` ranks (its routing is
    dropless and per token; ``colossal.moe.MoE`` layers, whose capacity and aux loss are per rank,
    raise ``ValueError``: ``[Note: expert x sequence parallelism]`` in :mod:`colossalai.booster.hybrid.ep`).
    ``find_unused_parameters`` is DDP's, as in ``TorchDDPPlugin`` (a model with parameters that get no
    gradient in a step, under dp > 1 without ZeRO).
    Not supported (``NotImplementedError``): ``zero_stage=3``, fp16 with ``zero_stage`` 1/2 (the
    Booster refuses it when built). ``ep_size > 1`` with a ``tp_mode`` other than 1d raises
    ``ValueError`` (ep composes with dp, ZeRO 1/2, 1D tp, pp and, for Mixtral, sp).
    """

    name = "hybrid"

    def __init__(
        self,
        *,
        tp_size: int = 2,
        tp_mode: str = "1d",
        tp_depth: int = 1,
        sp_size: int = 1,
        sp_kind: str = "ring",
        zero_stage: int = 0,
        pp_size: int = 1,
        num_microbatches: int | None = None,
        pp_schedule: str = "1f1b",
        pp_virtual: int = 1,
        ep_size: int = 1,
        plan: dict | None = None,
        find_unused_parameters: bool = False,
    ) -> None:
        if not isinstance(find_unused_parameters, bool):
            raise TypeError(f"find_unused_parameters must be a bool, got {find_unused_parameters!r}")
        sizes = (("tp_size", tp_size), ("tp_depth", tp_depth), ("sp_size", sp_size), ("pp_size", pp_size))
        sizes += (("ep_size", ep_size),)
        sizes += (("pp_virtual", pp_virtual),)
        sizes += (("num_microbatches", 1 if num_microbatches is None else num_microbatches),)  # None: pp_size
        for arg, value in sizes:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{arg} must be a positive int, got {value!r}")
        if tp_mode not in TP_MODES:
            raise NotImplementedError(f"HybridParallelPlugin supports tp_mode in {TP_MODES}, got {tp_mode!r}")
        if sp_kind not in SP_KINDS:
            raise ValueError(f"sp_kind must be one of {SP_KINDS}, got {sp_kind!r}")
        if zero_stage not in ZERO_STAGES:
            raise NotImplementedError(f"HybridParallelPlugin supports zero_stage in {ZERO_STAGES}, got {zero_stage!r}")
        if pp_schedule not in SCHEDULES:
            raise ValueError(f"pp_schedule must be one of {SCHEDULES}, got {pp_schedule!r}")
        check_layout(tp_size, tp_mode, tp_depth)
        if ep_size > 1:  # see [Note: expert parallelism in the hybrid plugin] for what composes
            if tp_size > 1 and tp_mode != "1d":
                raise ValueError(
                    f"ep_size={ep_size} composes with dp (DDP or zero_stage 1/2), 1D tp, pp and (Hugging Face "
                    f"Mixtral) sp, not with tp_mode={tp_mode!r} (unsupported combination)"
                )
        self.plan = None if plan is None else check_user_plan(plan)
        """The user's module-name pattern -> Style(s) (``[Note: one plan for tensor and sequence
        parallelism]`` in :mod:`.plans`); ``None``: the built-in plan of the model's family."""
        self.ep_size = ep_size
        self.find_unused_parameters = find_unused_parameters
        """Passed to DDP over the dp (x sp) group, as ``TorchDDPPlugin``'s: a parameter that gets no
        gradient in a step is allowed (and left untouched, as in plain PyTorch)."""
        self._ep: ExpertParallel | None = None  # what apply_expert_parallel did (ep_size > 1)
        self._ep_rows = False  # load_checkpoint_pieces: expert templates are this rank's rows
        self.tp_size, self.tp_mode, self.tp_depth = tp_size, tp_mode, tp_depth
        self.pp_size, self.pp_schedule, self.pp_virtual = pp_size, pp_schedule, pp_virtual
        self.num_microbatches = pp_size if num_microbatches is None else num_microbatches
        self._pipe, self._precision = None, None  # colossal.pipeline.PipelineParallel when pp_size > 1
        self._pp_prefix = ""  # the pipeline's parameter names + this = the model's (a peft model: its base's prefix)
        self._pp_inputs: tuple | None = None  # a Hugging Face pipeline's (first input, extra inputs)
        self._scaler = None  # fp16 under pp: the loss is scaled inside the pipeline
        self._aux_sink: list | None = None  # pp: MoE aux losses backpropagated this step (add_moe_aux_losses)
        self._aux_weight = 1.0
        self.sp_size, self.sp_kind, self.zero_stage = sp_size, sp_kind, zero_stage
        self._zero, self._zero_names = None, []  # ZeroOptimizer over dp (x sp), its index -> name
        self.mesh = None
        self._dense_shapes: dict[str, torch.Size] = {}
        self._shards: ShardIndex | None = None  # 2D/2.5D/3D state gather/split maps

    @property
    def supported_precisions(self) -> tuple[Precision, ...]:
        """fp32, bf16 and fp16; not fp16 with ZeRO (its fp32-engine scaler would not scale the loss)."""
        if self.zero_stage:
            return (Precision.FP32, Precision.BF16)
        return (Precision.FP32, Precision.BF16, Precision.FP16)

    @property
    def _inner(self) -> tuple[str, int]:
        """The mesh axis whose ranks hold different blocks of the parameters (tp; sp without tp),
        and its size."""
        return ("sp", self.sp_size) if self.tp_size == 1 and self.sp_size > 1 else ("tp", self.tp_size)

    def _build_mesh(self):
        from colossal.comm import Mesh

        size = self.tp_size * self.sp_size * self.pp_size
        if world_size() % size:
            raise ValueError(
                f"world size {world_size()} must be divisible by pp_size * tp_size * sp_size = "
                f"{self.pp_size} * {self.tp_size} * {self.sp_size}"
            )
        if self.mesh is None:  # pp outermost, tp innermost (the most talkative axis)
            axes = {"pp": self.pp_size, "dp": world_size() // size, "sp": self.sp_size, "tp": self.tp_size}
            self.mesh = Mesh(axes={a: n for a, n in axes.items() if n > 1 or a == "dp" or a == self._inner[0]})
        return self.mesh

    @property
    def dp_group(self):
        """The data-parallel process group."""
        return self._build_mesh().group("dp")

    def dp_size(self) -> int:
        """Replicas along the dp axis."""
        return world_size() // (self.tp_size * self.sp_size * self.pp_size)

    def dp_rank(self) -> int:
        """This rank's dp coordinate (tp / sp peers read the same data)."""
        return self._build_mesh().coordinate("dp")

    def configure(self, model: nn.Module, optimizer, precision):
        """Materialise, then apply the axes in the order of ``[Note: the order of the axes]``."""
        if is_peft_model(model):  # before any process group or collective: what LoRA adapters compose with
            check_lora_layout(tp_mode=self.tp_mode if self.tp_size > 1 else "1d", tp_size=self.tp_size, model=model)
            if self.ep_size > 1:
                check_frozen_experts(model, expert_layers)
        ensure_process_group("HybridParallelPlugin")  # a plain single process gets a world of one
        if self.ep_size > 1:  # before any collective (the mesh creates groups)
            check_ep(model, self.ep_size, self.dp_size() * self.sp_size, self.sp_size)
        plan = model_plan(
            model, self.plan, tp_size=self.tp_size, sp_size=self.sp_size, tp_mode=self.tp_mode,
            sp_kind=self.sp_kind, pp_size=self.pp_size, tp_depth=self.tp_depth,
        )  # fmt: skip
        mesh = self._build_mesh()
        names = param_names(model)
        pp_cfg = None
        policy = plan.policy if plan is not None else None
        if self.pp_size > 1:
            pp_cfg = pipeline_config(
                model, num_microbatches=self.num_microbatches, schedule=self.pp_schedule, virtual=self.pp_virtual,
                blocks=getattr(policy, "pp_blocks", None),
            )  # fmt: skip
        if pp_cfg is not None and any(t.is_meta for t in model.parameters()):  # only this rank's stages
            hf = policy if getattr(policy, "pp_blocks", None) is not None else None
            materialize_stages(lora_base(model), mesh, pp_cfg, self.device, hf)
        else:
            model = materialize_(model, self.device)
        self._dense_shapes = {n: p.shape for n, p in model.named_parameters(remove_duplicate=False)}
        frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        self._precision = precision
        with torch.profiler.record_function("colossalai.booster::hybrid_parallelize"):
            wrapped, gather = model, None
            # 1. tp converts the dense layers (tp_size=1 without a plan: nothing to convert)
            if plan is not None and (self.tp_size > 1 or self.sp_size == self.pp_size == 1):
                wrapped, self._shards = apply_tp(model, mesh, self.tp_mode, self.tp_depth, plan)
                gather = wrapped.gather
            if self.sp_size > 1:  # 2. sp: attention over sequence chunks, on the (tp) layers
                wrapped = apply_sp(model, wrapped, mesh, self.sp_kind, self._dense_shapes, plan)
            if self.ep_size > 1:  # 3. ep swaps each MoE for this rank's experts (before pp captures them)
                self._ep = apply_expert_parallel(model, self.ep_size, dp_group(mesh, self.sp_size), wrapped)
            if self.pp_size > 1:  # 4. pp cuts the converted model into this rank's stages
                sp = mesh.group("sp") if self.sp_size > 1 else None
                base = lora_base(model)  # a peft model: its base's blocks (the stages name parameters from there)
                self._pipe = apply_pp(base, mesh, pp_cfg, gather=gather, sp=sp, device=self.device, policy=policy)
                self._pp_prefix = base_prefix(model)
                if getattr(policy, "pp_blocks", None) is not None:
                    from colossalai.policies.hf_pipeline import PIPELINE_INPUTS

                    self._pp_inputs = PIPELINE_INPUTS[policy.model_type]
                wrapped = PipelineModule(model, self._pipe)
        for n, p in model.named_parameters(remove_duplicate=False):  # the axes' new layers (tp, ep) start trainable
            if n in frozen:
                p.requires_grad_(False)
        rebind_optimizer(optimizer, names, model)
        if self._pipe is not None and optimizer is not None:  # only the parameters of this rank's stages
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if not p.is_meta]
        # 5. dp last, over exactly the parameters this rank keeps: ZeRO, or DDP (pp: an average per step)
        group = dp_group(mesh, self.sp_size)
        if self.zero_stage:
            return wrapped, self._zero_optimizer(model, optimizer, group)
        optimizer = self._clipping_optimizer(model, optimizer, precision, mesh)
        if self._pipe is not None:
            return wrapped, optimizer
        return apply_ddp(wrapped, group, self.device, self.find_unused_parameters), optimizer

    def _clipping_optimizer(self, model: nn.Module, optimizer, precision, mesh):
        """The optimizer view that clips by the dense norm: over tp (or sp), or over pp x tp."""
        if optimizer is None:
            return None
        if self._pipe is not None and self._ep is not None:  # experts: see ExpertPipelineOptimizer
            replicas = expert_free_replicas(
                model, self._ep, self._dense_shapes, self.tp_size, self._pipe, self._pp_prefix
            )
            self._scaler = _fp16_scaler() if precision is Precision.FP16 else None
            dp, tp = self.dp_size(), self.tp_size
            return ExpertPipelineOptimizer(optimizer, model, self._ep, replicas, dp, tp, self._scaler)
        if self._pipe is not None:
            replicas = replicas_over_pp_tp(self._pipe, self._dense_shapes, self.tp_size, self._pp_prefix)
            norm_group = mesh.product_group("pp", "tp") if "tp" in mesh.axes else mesh.group("pp")
            self._scaler = _fp16_scaler() if precision is Precision.FP16 else None  # scales inside the pipeline
            return PipelineOptimizer(optimizer, replicas, norm_group, self._scaler)
        scaler = _fp16_scaler() if precision is Precision.FP16 else None
        axis, size = self._inner
        experts = self._ep.dense_shapes if self._ep is not None else {}
        replicas = [
            (p, multiplicity(p, self._dense_shapes[n], size)) for n, p in model.named_parameters() if n not in experts
        ]
        if self._ep is not None:
            return ExpertParallelOptimizer(optimizer, model, self._ep, replicas, mesh.group(axis), size, scaler)
        return TensorParallelOptimizer(optimizer, replicas, mesh.group(axis), size, scaler)

    def execute_pipeline(self, model: nn.Module, x, y: torch.Tensor, criterion) -> torch.Tensor:
        """Forward and backward of the batch ``(x, y)`` through the pipeline, gradients reduced
        over dp; returns the batch loss (the same on every rank of the pipeline). For a Hugging
        Face model ``x`` may be a dict of ``input_ids`` with ``attention_mask`` and/or
        ``position_ids`` (every stage's blocks use them; ``pixel_values`` for ViT), and
        ``criterion(logits, y)`` sees the whole logits of each micro-batch."""
        if self._pipe is None:
            raise RuntimeError("execute_pipeline needs a model boosted with pp_size > 1")
        x, extras = pipeline_inputs(x, self._pp_inputs)  # on every rank, before any transfer
        if self.sp_size > 1 and (x.dim() < 2 or x.shape[1] % self.sp_size):  # on every rank, before any transfer
            raise ValueError(
                f"sequence parallel needs the sequence length divisible by sp_size={self.sp_size}, "
                f"got inputs of shape {tuple(x.shape)}"
            )
        amp = self._precision is not None and self._precision is not Precision.FP32
        ctx = torch.autocast(self.device.type, dtype=self._precision.dtype) if amp else contextlib.nullcontext()
        if self._zero is not None:
            with self._zero.no_sync(), ctx:
                loss = self._pipe.step(x, y, criterion, extras=extras)
            # the first backward outside no_sync reduces what the micro-batches accumulated
            torch.stack([p.reshape(-1)[0] for p in self._pipe.parameters()]).sum().mul(0.0).backward()
            aux = self._stage_aux_losses()  # MoE aux losses of every stage (Booster(moe_aux_loss=True))
            return loss if aux is None else loss + aux.to(loss.device)
        scaler = self._scaler
        loss_fn = criterion if scaler is None else (lambda out, target: scaler.scale_loss(criterion(out, target)))
        with ctx:
            loss = self._pipe.step(x, y, loss_fn, extras=extras)
        params = list(self._pipe.parameters())
        if self._ep is not None:  # experts reduce over edp once per step, in the optimizer
            experts = {id(p) for p in self._ep.expert_parameters(self.unwrap(model))}
            params = [p for p in params if id(p) not in experts]
        average_over_dp(params, dp_group(self.mesh, self.sp_size))  # dp (x sp)
        loss = loss if scaler is None else loss / scaler.scale
        aux = self._stage_aux_losses()  # MoE aux losses of every stage (Booster(moe_aux_loss=True))
        return loss if aux is None else loss + aux.to(loss.device)

    def add_moe_aux_losses(self, model: nn.Module) -> None:
        """Pipeline parallelism: every MoE layer on this rank's stages adds its aux loss of each
        micro-batch through its output (``[Note: MoE auxiliary losses]`` in
        :mod:`colossalai.booster.booster`); ``execute_pipeline`` then reports it in the loss."""
        from colossal.moe import attach_aux_loss, moe_layers

        if self._pipe is None:
            raise RuntimeError("add_moe_aux_losses is for pp_size > 1, after boost")
        m = self.num_microbatches if self._pipe.config.loss_reduction == "mean" else 1

        def attach(layer, args, out):
            if layer.aux_loss is None or not torch.is_grad_enabled():
                return out
            scale = self._scaler.scale if self._scaler is not None else 1.0
            return attach_aux_loss(out, layer.aux_loss, scale / m, self._aux_sink)

        for layer in moe_layers(model):
            if not layer.router.gate.weight.is_meta:  # this rank's stages only
                layer.register_forward_hook(attach)
        self._aux_sink, self._aux_weight = [], 1.0 / m

    def _stage_aux_losses(self) -> torch.Tensor | None:
        """The aux losses every stage backpropagated in the last pipeline step, weighted as in the
        loss and summed over pp (``None`` unless :meth:`add_moe_aux_losses` ran). Collective over pp."""
        if self._aux_sink is None:
            return None
        from colossal.comm import all_reduce

        local = torch.stack(self._aux_sink).float().sum() if self._aux_sink else torch.zeros(())
        local = (local * self._aux_weight).to(self.device)
        self._aux_sink.clear()
        return all_reduce(local, group=self.mesh.group("pp"), tag="hybrid.pp.moe_aux")

    def _zero_optimizer(self, model: nn.Module, optimizer, group) -> HybridZeroOptimizer:
        """ZeRO over ``group``; under tp it clips by the dense norm over the world (dp x sp x tp),
        under pp over every stage too (ZeRO then sees this rank's stages only)."""
        if self._ep is not None:  # dense over dp, experts over edp: [Note: ZeRO with expert parallelism]
            replicas = expert_free_replicas(
                model, self._ep, self._dense_shapes, self.tp_size, self._pipe, self._pp_prefix
            )
            self._zero = ExpertZeroOptimizer(optimizer, model, self._ep, self.zero_stage, group, replicas, self.tp_size)
            return self._zero
        target = stage_view(model) if self._pipe is not None else model
        self._zero, self._zero_names = zero_engine(target, optimizer, self.zero_stage, group)
        if self._pipe is not None:
            replicas = replicas_over_pp_tp(self._pipe, self._dense_shapes, self.tp_size, self._pp_prefix)
            return HybridZeroOptimizer(self._zero, replicas, group=None)
        if self.tp_size == 1:  # ZeRO's own clip spans every rank
            return HybridZeroOptimizer(self._zero)
        shapes, tp = self._dense_shapes, self.tp_size
        replicas = {id(p): multiplicity(p, shapes[n], tp) for n, p in model.named_parameters()}
        return HybridZeroOptimizer(self._zero, replicas, group=None)  # None: the default group, the world

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The (tensor- and/or sequence-parallel) user module."""
        while isinstance(model, (DDP, GatherLogits, SequenceParallel, PipelineModule)):
            model = model.module
        return model

    def no_sync(self, model: nn.Module, optimizer) -> contextlib.AbstractContextManager:
        """DDP's (or ZeRO's) ``no_sync`` over the dp (x sp) axis."""
        if self._zero is not None:
            return self._zero.no_sync()
        return model.no_sync() if isinstance(model, DDP) else contextlib.nullcontext()

    # ---- state: dense names and logical shapes (see the module note) ----------------------------
    def _to_portable(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """1D: a tp DTensor; 2D/2.5D/3D: the gathered dense tensor; sequence parallel: as is;
        an expert parameter (ep): gathered over ``ep`` to every expert."""
        if self._ep is not None and name in self._ep.dense_shapes:
            return self._ep.to_portable(name, local, rows=self._ep_rows)
        if self._shards is not None:
            return self._shards.gather(name, local)
        if self.tp_size == 1 and self.sp_size > 1:  # replicated
            return local
        dense = self._dense_shapes[name]
        dims = [d for d in range(local.dim()) if local.shape[d] != dense[d]]
        placement = Shard(dims[0]) if dims else Replicate()
        return DTensor.from_local(local, self.mesh.device_mesh["tp"], [placement], run_check=False)

    def _to_local(self, name: str, state: torch.Tensor) -> torch.Tensor:
        if self._ep is not None and name in self._ep.dense_shapes:
            return self._ep.to_local(name, state)
        if isinstance(state, DTensor):
            return state.to_local()
        return self._shards.split(name, state) if self._shards is not None else state

    def load_checkpoint_pieces(self, model: nn.Module, optimizer, reader) -> None:
        """As every plugin, with expert tensors templated as this rank's rows over ``ep`` (a
        ``DTensor`` ``Shard(0)``), so each rank reads only its own experts' pieces."""
        self._ep_rows = self._ep is not None
        try:
            super().load_checkpoint_pieces(model, optimizer, reader)
        finally:
            self._ep_rows = False

    def model_state_dict(self, model: nn.Module) -> dict:
        """Parameters under their dense names with their dense logical shapes (buffers as they are)."""
        module = self.unwrap(model)
        params = dict(module.named_parameters(remove_duplicate=False))  # tied names included
        local = self._zero.full_model_state_dict() if self._zero is not None else module.state_dict()
        local = {n: t for n, t in local.items() if not t.is_meta}  # pipeline: this rank's stages only
        if self._zero is not None and self._pipe is not None:  # ZeRO's stage view names a tie once
            first = {}
            for n, p in params.items():
                alias = first.setdefault(id(p), n)
                if alias in local and n not in local:
                    local[n] = local[alias]
        return {n: self._to_portable(n, t.detach().to(self.device)) if n in params else t for n, t in local.items()}

    def load_model_state_dict(self, model: nn.Module, state: dict) -> None:
        """Copy this rank's block of each loaded tensor into the parameter."""
        module = self.unwrap(model)
        params = dict(module.named_parameters(remove_duplicate=False))
        if isinstance(self._zero, ExpertZeroOptimizer):  # takes what this rank holds
            local = {n: self._to_local(n, t) if n in params else t for n, t in state.items()}
            return self._zero.load_full_model_state_dict(local)
        if self._zero is not None:
            local = {n: self._to_local(n, t) if n in params else t for n, t in state.items()}
            return self._zero.load_full_model_state_dict({n: local[n] for n in self._zero.module.state_dict()})
        with torch.no_grad():
            for n, t in module.state_dict(keep_vars=True).items():
                if not t.is_meta:  # pipeline: other stages' tensors are meta here
                    t.copy_(self._to_local(n, state[n]) if n in params else state[n])

    def full_model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The dense model (gathered over tp) on every rank."""
        sd = self.model_state_dict(model)
        full = {n: t.full_tensor().cpu() if isinstance(t, DTensor) else t.cpu() for n, t in sd.items()}
        if self.pp_size > 1:  # each stage holds its own tensors: merge them over pp
            parts = [None] * self.pp_size
            torch.distributed.all_gather_object(parts, full, group=self.mesh.group("pp"))
            full = {n: t for part in parts for n, t in part.items()}
        return full

    def checkpoint_entries(self, model: nn.Module) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every stage's entries: a pipeline rank holds only its own stages' tensors, but a
        checkpoint (and the strict check against it) is of the whole model. Collective over pp.
        Read from the dense shapes recorded before conversion: nothing is gathered over tp (an
        expert model's entries come from its portable state dict)."""
        if self._ep is not None:
            entries = super().checkpoint_entries(model)
        else:
            module = self.unwrap(model)
            params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
            meta = lambda n, t: torch.empty(self._dense_shapes[n], dtype=t.dtype, device="meta")  # noqa: E731
            state = {n: meta(n, t) if n in params else t for n, t in module.state_dict().items() if not t.is_meta}
            entries = model_entries(state, aliases(module))
        if self.pp_size > 1:
            parts = [None] * self.pp_size
            torch.distributed.all_gather_object(parts, entries, group=self.mesh.group("pp"))
            entries = {k: v for part in parts for k, v in part.items()}
        return entries

    def optimizer_state_dict(self, model: nn.Module, optimizer) -> dict:
        """torch's name-keyed optimizer state with parameter-shaped entries made portable."""
        if isinstance(self._zero, ExpertZeroOptimizer):
            sd = self._zero.named_state_dict()
        elif self._zero is not None:
            sd = zero_optimizer_state(self._zero, self._zero_names)
        else:
            sd = super().optimizer_state_dict(self.unwrap(model), optimizer)
        portable = lambda n, v: self._to_portable(n, v.to(self.device)) if v.dim() > 0 else v  # noqa: E731
        # new entry dicts: torch's state dict may share them with the live optimizer state
        state = {
            n: {k: portable(n, v) if isinstance(v, torch.Tensor) else v for k, v in e.items()}
            for n, e in sd["state"].items()
        }
        return {**sd, "state": state}

    def load_optimizer_state_dict(self, model: nn.Module, optimizer, state: dict) -> None:
        """This rank's blocks of the loaded entries back into the optimizer."""
        for name, entry in state["state"].items():
            for k, v in entry.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    entry[k] = self._to_local(name, v)
        if isinstance(self._zero, ExpertZeroOptimizer):
            return self._zero.load_named_state_dict(state)
        if self._zero is not None:
            return load_zero_optimizer(self._zero, self._zero_names, state)
        super().load_optimizer_state_dict(self.unwrap(model), optimizer, state)

    def __repr__(self) -> str:
        parts = [f"tp_size={self.tp_size}, tp_mode={self.tp_mode!r}"] if self.tp_size > 1 or self.sp_size == 1 else []
        parts += [f"sp_size={self.sp_size}, sp_kind={self.sp_kind!r}"] if self.sp_size > 1 else []
        parts += [f"zero_stage={self.zero_stage}"] if self.zero_stage else []
        if self.pp_size > 1:
            parts += [
                f"pp_size={self.pp_size}, num_microbatches={self.num_microbatches}, pp_schedule={self.pp_schedule!r}"
            ]
            parts += [f"pp_virtual={self.pp_virtual}"] if self.pp_virtual > 1 else []
        parts += [f"ep_size={self.ep_size}"] if self.ep_size > 1 else []
        parts += [f"plan={{{len(self.plan)} patterns}}"] if self.plan is not None else []
        return f"HybridParallelPlugin({', '.join(parts)})"
