"""Policies for Hugging Face ``transformers`` families: 1D tensor parallelism (the rules are data in
``colossal.tensor_parallel.HF_TP_RULES``, GPT-2's ``Conv1D`` layers are converted here) and
sequence parallelism (:mod:`.hf_sequence`), with the checks each family needs.

[Note: what every Hugging Face policy does]
* **Tensor parallel (1D)**: q/k/v and the MLP's input projections column-parallel, the attention
  output and the MLP's output projection row-parallel; the heads of each rank are a contiguous
  block (q, k and v of the same heads), so the attention core runs unchanged on ``h/tp`` heads
  (Hugging Face attention modules infer the head count from the projection width). Embeddings,
  norms, poolers and task heads stay replicated, so tied input/output embeddings stay tied and the
  model's output is not split. ``tp_mode="1d"``; ViT also 2D, 2.5D and 3D (below).
* **Tensor parallel (2D, 2.5D, 3D; ViT)**: these modes split every activation by batch block and
  hidden block, so the rules of ``colossal.tensor_parallel.HF_GRID_RULES`` convert the rest of the
  model too: the ``Conv2d`` patch projection (``Style.PATCH_EMBED``), the ``cls_token`` and
  ``position_embeddings`` (``Style.VISION_EMBED``), the LayerNorms (``Style.NORM``), and the
  classifier, which runs replicated on the gathered CLS tokens (``Style.GATHER``): the logits come
  out whole. Not with pipeline or sequence parallelism.
* **Sequence parallel**: the model keeps its inputs and outputs; the ``(B, T, C)`` sequence is
  split after the embeddings (padded to a multiple of ``sp_size``, the padding masked out) and
  gathered after the last norm; the attention core becomes ring or all-to-all attention that
  keeps the module's ``is_causal`` and the user's ``attention_mask`` (key padding).
* **Pipeline parallel** (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``BertForMaskedLM``,
  ``ViTForImageClassification``): the block sequence named by ``pp_blocks`` is split into stages,
  embeddings on the first, final norm and head (``pp_head``) on the last; each stage runs the
  model's own forward cut at block boundaries, with the user's ``attention_mask`` and position ids
  (:mod:`.hf_pipeline`). Composes with 1D tensor parallelism and data parallelism; not with
  sequence parallelism. ``MixtralForCausalLM`` too (as Llama). Other heads of these families raise
  ``NotImplementedError``.
  [Note: Mixtral's router aux loss under pp] ``transformers``' load-balancing loss is
  ``E * sum_e mean(tokens routed to e) * mean(router prob of e)``, each mean over the tokens of
  *every* layer together: a product of whole-model means, not a sum of per-layer terms, so no stage
  can add its share. A Mixtral with ``output_router_logits=True`` is refused under pp (before any
  collective); with it off the pipeline trains the cross entropy exactly as the model does.
* **Expert parallel** (families with :attr:`HFPolicy.experts`, Mixtral): ``ep_size > 1`` replaces
  each sparse-MoE block by one holding this rank's experts (:mod:`.hf_moe`), composed with dp and
  1D tp by :mod:`colossalai.booster.hybrid.ep`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["HFPolicy", "GPT2Policy", "HF_POLICIES", "hf_policy"]


def _config(model: nn.Module):
    return getattr(model, "config", None)


@dataclass(kw_only=True, slots=True)
class HFPolicy:
    """How one ``transformers`` family is split (see ``[Note: what every Hugging Face policy does]``)."""

    model_type: str
    """``config.model_type`` this policy serves."""
    attention: str
    """Regex over the end of module names: the modules that call the attention function."""
    split_after: str
    """Regex: the module whose output is the ``(B, T, C)`` sequence entering the layers (split there)."""
    gather_after: str
    """Regex: the module whose output is gathered back to the whole sequence."""
    rotary: str | None = None
    """Regex: a rotary embedding whose ``position_ids`` must become global positions."""
    permutes: bool = False
    """The tensor-parallel layout is not one contiguous split per parameter (checkpoints use index maps)."""
    mlp_width: str = "intermediate_size"
    """The config attribute holding the MLP's hidden width (divided by ``tp_size``)."""
    pp_blocks: str | None = None
    """Dotted name of the block sequence the pipeline splits (``None``: no pipeline plan)."""
    pp_head: str = "lm_head"
    """The module the last stage ends with (the causal LM head); its absence means a model class
    the pipeline stages do not cover (a bare ``GPT2Model``, a classification head)."""
    experts: str | None = None
    """Regex: the sparse mixture-of-experts blocks that ``ep_size > 1`` splits (``None``: no experts)."""
    tp_modes: tuple[str, ...] = ("1d",)
    """The tensor-parallel modes of the family (2D/2.5D/3D need ``HF_GRID_RULES`` for it)."""

    def check(
        self, model: nn.Module, tp_size: int, sp_size: int, tp_mode: str, sp_kind: str, pp_size: int, tp_depth: int = 1
    ) -> None:
        """Raise (``ValueError`` with the values, ``NotImplementedError`` with what is supported)
        before anything is built, identically on every rank."""
        if pp_size > 1:
            self._check_pipeline(model, pp_size, sp_size)
        if tp_size > 1 and tp_mode not in self.tp_modes:
            raise NotImplementedError(f"{self.model_type}: tp_mode {tp_mode!r}; supported: {self.tp_modes}")
        if tp_size > 1 and tp_mode != "1d":
            return self._check_grid(model, tp_size, sp_size, tp_mode, pp_size, tp_depth)
        cfg = _config(model)
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        width = getattr(cfg, self.mlp_width, None) or 4 * cfg.hidden_size
        for value, by, what in (
            (heads, tp_size, "num_attention_heads"),
            (kv, tp_size, "num_key_value_heads"),
            (width, tp_size, self.mlp_width),
        ):
            if value % by:
                raise ValueError(f"{self.model_type}: {what}={value} must be divisible by tp_size={tp_size}")
        if sp_size > 1 and sp_kind == "all_to_all" and (heads // tp_size) % sp_size:
            raise ValueError(
                f"{self.model_type}: all_to_all attention needs the heads per tp rank ({heads} / {tp_size}) "
                f"divisible by sp_size={sp_size}"
            )
        if sp_size > 1 and self.experts is not None and getattr(cfg, "output_router_logits", False):
            raise NotImplementedError(
                f"{self.model_type}: sequence parallelism (sp_size={sp_size}) with config.output_router_logits=True: "
                "the router aux loss is a product of means over every token of the forward, and each rank "
                "routes only its sequence chunk; train with output_router_logits=False under sp"
            )
        if sp_size > 1:
            from colossalai.policies.hf_sequence import check_sequence

            check_sequence(self, model)

    def _check_grid(self, model: nn.Module, tp_size: int, sp_size: int, mode: str, pp_size: int, depth: int) -> None:
        """2D/2.5D/3D: the grid side ``q`` must divide the heads, ``q^2`` (2D, 2.5D) or ``q^3`` (3D)
        the hidden and MLP widths (every vector is split over the grid); no pp or sp."""
        if pp_size > 1 or sp_size > 1:
            raise NotImplementedError(
                f"{self.model_type}: tp_mode {mode!r} with pp_size={pp_size}, sp_size={sp_size}; "
                "2D/2.5D/3D compose with dp only (pipeline and sequence parallelism: tp_mode '1d')"
            )
        power = 3 if mode == "3d" else 2
        q = round((tp_size // depth) ** (1 / power))
        cfg = _config(model)
        width = getattr(cfg, self.mlp_width, None) or 4 * cfg.hidden_size
        for value, by, what, by_what in (
            (cfg.num_attention_heads, q, "num_attention_heads", f"the grid side q={q}"),
            (cfg.hidden_size, q**power, "hidden_size", f"q^{power}={q**power} (q={q})"),
            (width, q**power, self.mlp_width, f"q^{power}={q**power} (q={q})"),
        ):
            if value % by:
                raise ValueError(f"{self.model_type} tp_mode {mode!r}: {what}={value} must be divisible by {by_what}")

    def _check_pipeline(self, model: nn.Module, pp_size: int, sp_size: int) -> None:
        supported = [f"{t} ({p.pp_blocks} + {p.pp_head})" for t, p in HF_POLICIES.items() if p.pp_blocks is not None]
        if self.pp_blocks is None:
            raise NotImplementedError(
                f"{self.model_type}: pipeline parallelism (pp_size={pp_size}) is not available for this family; "
                f"supported Hugging Face families: {', '.join(supported)}"
            )
        if sp_size > 1:
            raise NotImplementedError(
                f"{self.model_type}: pipeline x sequence parallelism (pp_size={pp_size}, sp_size={sp_size}); "
                "a Hugging Face pipeline composes with tp_size (1d) and dp"
            )
        try:
            blocks = model.get_submodule(self.pp_blocks)
            model.get_submodule(self.pp_head)
        except AttributeError:
            raise NotImplementedError(
                f"{self.model_type}: pipeline parallelism covers the model with {self.pp_blocks} and {self.pp_head}; "
                f"{type(model).__name__} has {sorted(n for n, _ in model.named_children())}"
            ) from None
        n = len(blocks) if isinstance(blocks, nn.ModuleList) else 0
        if n < pp_size or n % pp_size:
            raise ValueError(
                f"{self.model_type}: {n} layers ({self.pp_blocks}) must be divisible by pp_size={pp_size} "
                "(one equal share of the layers per stage)"
            )
        if getattr(_config(model), "output_router_logits", False):  # [Note: Mixtral's router aux loss under pp]
            raise NotImplementedError(
                f"{self.model_type}: pipeline parallelism (pp_size={pp_size}) with config.output_router_logits=True: "
                "the router aux loss is one product of means over every layer's router logits, which no stage "
                "holds together; train with output_router_logits=False under pp, or without pp"
            )
        if getattr(_config(model), "is_decoder", False) and self.model_type == "bert":
            raise NotImplementedError("bert: pipeline parallelism of a decoder (config.is_decoder); supported: encoder")
        base = model.get_submodule(self.pp_blocks.split(".")[0])
        if isinstance(getattr(base, "pooler", None), nn.Module):  # the stages' head does not run a pooler
            raise NotImplementedError(
                f"{self.model_type}: pipeline parallelism of {type(model).__name__} (a pooler head); supported: "
                "GPT2LMHeadModel, LlamaForCausalLM, BertForMaskedLM, ViTForImageClassification"
            )

    def init_weights(self, model: nn.Module) -> None:
        """Initialise the real modules of a model built on the meta device (pipeline parallel: this
        rank's stages) with the model's own ``_init_weights``, each module after its children as
        ``transformers`` does, so the distributions and the non-persistent buffers (BERT's
        ``position_ids``) are the model's. Modules holding a meta tensor (other stages') are skipped."""
        from colossalai.booster.ddp_plugin import _model_init

        if not _model_init(model):
            raise NotImplementedError(f"{self.model_type}: {type(model).__name__} has no _init_weights to run")

    def stage_fns(self, model: nn.Module, device: torch.device):
        """``(embed, head, block_call)`` of the pipeline stages (:func:`.hf_pipeline.hf_stage_fns`)."""
        from colossalai.policies.hf_pipeline import hf_stage_fns

        return hf_stage_fns(self.model_type, model, device)

    def plan(self, model: nn.Module, mode: str = "1d") -> dict:
        """The ``Style`` plan of ``model`` in tensor-parallel ``mode`` (``colossal.tensor_parallel.hf_plan``)."""
        from colossal.tensor_parallel import hf_plan

        return hf_plan(model, self.model_type, mode)

    def convert_tp(self, model: nn.Module, group, mode: str) -> None:
        """Modules the ``Style`` plan cannot express (none for this family)."""

    def expert_blocks(self, model: nn.Module) -> dict[str, nn.Module]:
        """Name -> sparse-MoE block that expert parallelism splits (empty without :attr:`experts`).
        Raises ``NotImplementedError`` for a block not in the ``transformers`` 5.x layout."""
        if self.experts is None:
            return {}
        import re

        from colossalai.policies.hf_moe import is_mixtral_moe_block

        found = {n: m for n, m in model.named_modules() if re.search(rf"(^|\.)({self.experts})$", n)}
        bad = sorted(f"{n} ({type(m).__name__})" for n, m in found.items() if not is_mixtral_moe_block(m))
        if bad:
            raise NotImplementedError(
                f"{self.model_type}: expert parallelism needs the transformers 5.x sparse-MoE layout (a router "
                f"'gate' and stacked 'experts.gate_up_proj' / 'experts.down_proj'); not in it: {bad}"
            )
        return found

    def split_experts(self, block: nn.Module, group) -> nn.Module:
        """``block`` with only this rank's experts of ``group`` (:mod:`.hf_moe`)."""
        from colossalai.policies.hf_moe import MixtralExpertParallelBlock

        return MixtralExpertParallelBlock(block, group)

    def apply_sequence(self, model: nn.Module, inner: nn.Module, group, kind: str) -> nn.Module:
        """Make ``model`` sequence parallel over ``group`` in place; returns the module to run."""
        from colossalai.policies.hf_sequence import apply_hf_sequence

        apply_hf_sequence(self, model, group, kind)
        return inner


def _conv1d_as_linear(conv: nn.Module, rows: torch.Tensor | None = None) -> nn.Linear:
    """A ``transformers`` ``Conv1D`` (``weight (in, out)``) as an ``nn.Linear`` (``weight (out, in)``),
    its output features reordered by ``rows`` when given."""
    w = conv.weight.detach().t()  # (out, in)
    linear = nn.utils.skip_init(
        nn.Linear, w.shape[1], w.shape[0], bias=conv.bias is not None, device=w.device, dtype=w.dtype
    )
    with torch.no_grad():
        linear.weight.copy_(w if rows is None else w[rows])
        if conv.bias is not None:
            linear.bias.copy_(conv.bias if rows is None else conv.bias[rows])
    return linear


def _per_head_rows(width: int, parts: int, shards: int) -> torch.Tensor:
    """Output rows of a fused ``[q | k | v]`` projection (each ``width`` wide) reordered so that a
    contiguous split in ``shards`` gives shard ``r`` its ``q``, ``k`` and ``v`` of the same heads."""
    c = width // shards
    return torch.cat(
        [torch.arange(p * width + r * c, p * width + (r + 1) * c) for r in range(shards) for p in range(parts)]
    )


class GPT2Policy(HFPolicy):
    """GPT-2: ``Conv1D`` layers (transposed weights), a fused ``c_attn`` q/k/v projection, learned
    positions (``wpe``), input and output embeddings tied.

    Tensor parallel: ``c_attn`` column-parallel *per head* (rank ``r`` holds q, k and v of heads
    ``r*h/tp ..``, not a contiguous block of the fused rows), ``c_fc`` column-, both ``c_proj``
    row-parallel; ``split_size`` and ``num_heads`` of each attention are divided by ``tp_size``;
    ``wte``/``wpe``/``lm_head`` replicated (tied). Sequence parallel: split after ``drop`` (the
    summed token and position embeddings), causal ring / all-to-all attention with the padding
    mask, gathered after ``ln_f``."""

    __slots__ = ()

    def plan(self, model: nn.Module, mode: str = "1d") -> dict:
        """No ``Style`` entries: every split layer is a ``Conv1D`` (:meth:`convert_tp`)."""
        return {}

    def convert_tp(self, model: nn.Module, group, mode: str) -> None:
        """Replace each block's ``Conv1D`` layers by ``colossal.tensor_parallel.Linear1D``."""
        import re

        import torch.distributed as dist

        from colossal.tensor_parallel import Linear1D, replace_module

        p = dist.get_world_size(group)
        blocks = [(n, m) for n, m in model.named_modules() if re.search(r"(^|\.)h\.\d+$", n)]
        blocks = [(n, m) for n, m in blocks if not any(p.is_meta for p in m.parameters())]  # pp: other stages'
        built = []
        for name, block in blocks:
            c = block.attn.split_size
            rows = _per_head_rows(c, 3, p)
            c_attn = Linear1D.from_dense(_conv1d_as_linear(block.attn.c_attn, rows), group, "col")
            c_attn.dense_rows = rows  # its output features in this order (a LoRA adapter's lora_B follows it)
            built += [
                (f"{name}.attn.c_attn", c_attn),
                (f"{name}.attn.c_proj", Linear1D.from_dense(_conv1d_as_linear(block.attn.c_proj), group, "row")),
                (f"{name}.mlp.c_fc", Linear1D.from_dense(_conv1d_as_linear(block.mlp.c_fc), group, "col")),
                (f"{name}.mlp.c_proj", Linear1D.from_dense(_conv1d_as_linear(block.mlp.c_proj), group, "row")),
            ]
        for name, new in built:
            replace_module(model, name, new)
        for _, block in blocks:  # heads are read from the width; the fused split point is per rank
            block.attn.split_size //= p
            block.attn.num_heads //= p


HF_POLICIES: dict[str, HFPolicy] = {
    "gpt2": GPT2Policy(
        model_type="gpt2",
        attention=r"h\.\d+\.attn",
        split_after=r"drop",
        gather_after=r"ln_f",
        permutes=True,
        mlp_width="n_inner",
        pp_blocks="transformer.h",
    ),
    "llama": HFPolicy(
        model_type="llama",
        attention=r"layers\.\d+\.self_attn",
        split_after=r"embed_tokens",
        gather_after=r"model\.norm|^norm",
        rotary=r"rotary_emb",
        pp_blocks="model.layers",
    ),
    "mixtral": HFPolicy(
        model_type="mixtral",
        attention=r"layers\.\d+\.self_attn",
        split_after=r"embed_tokens",
        gather_after=r"model\.norm|^norm",
        rotary=r"rotary_emb",
        experts=r"layers\.\d+\.(mlp|block_sparse_moe)",  # transformers 5.x | 4.x (refused: not stacked)
        pp_blocks="model.layers",
    ),
    "bert": HFPolicy(
        model_type="bert",
        attention=r"layer\.\d+\.attention\.self",
        split_after=r"embeddings",
        gather_after=r"encoder",
        pp_blocks="bert.encoder.layer",
        pp_head="cls",
    ),
    "vit": HFPolicy(
        model_type="vit",
        attention=r"layers\.\d+\.attention",
        split_after=r"embeddings",
        gather_after=r"layernorm",
        pp_blocks="vit.layers",
        pp_head="classifier",
        tp_modes=("1d", "2d", "2.5d", "3d"),
    ),
}
"""``config.model_type`` -> policy. The docs page "Hugging Face models" tables what each does.

* ``gpt2``: :class:`GPT2Policy`; pipeline: ``transformer.h`` split into stages
  (``GPT2LMHeadModel``, tied ``wte``/``lm_head`` across the first and last stage).
* ``llama``: grouped-query attention (q heads and k/v heads both divided by ``tp_size``, so each
  must be divisible by it; a rank keeps ``num_key_value_groups``), RoPE (sequence parallel: the
  rotary embedding sees global positions), SwiGLU MLP (``gate_proj``/``up_proj`` column-,
  ``down_proj`` row-parallel); ``embed_tokens``/``lm_head`` replicated (tied or not). Pipeline:
  ``model.layers`` split into stages (``LlamaForCausalLM``).
* ``mixtral``: Llama attention split the same way; the sparse-MoE router is replicated on every
  rank and the experts are replicated on every tp rank, or, with ``ep_size > 1``, split over the
  ``ep`` group (each ``layers.N.mlp`` becomes a :class:`~colossalai.policies.hf_moe.MixtralExpertParallelBlock`
  that keeps Mixtral's routing and names; ``[Note: Mixtral's routing, kept exactly]``). Pipeline:
  ``model.layers`` split into stages as Llama's (``MixtralForCausalLM``, composes with ``ep_size``),
  without the router aux loss (``[Note: Mixtral's router aux loss under pp]``).
* ``bert``: bidirectional attention (``query/key/value`` column-, ``attention.output.dense``
  row-, ``intermediate.dense`` column-, ``output.dense`` row-parallel); sequence parallel splits
  after ``embeddings`` and gathers after ``encoder``, keeping the padding mask. Pipeline:
  ``bert.encoder.layer`` split into stages (``BertForMaskedLM``, tied word embeddings / decoder).
* ``vit``: bidirectional attention (``q/k/v_proj``, ``o_proj``, ``mlp.fc1``/``fc2``); sequence
  parallel splits the patch+CLS sequence after ``embeddings`` (padded to a multiple of ``sp_size``,
  the padding masked) and gathers after ``layernorm``. Pipeline: ``vit.layers`` split into stages
  (``ViTForImageClassification``, the classifier on the CLS token). Tensor parallel in every mode:
  2D, 2.5D and 3D also split the patch projection, ``cls_token``, ``position_embeddings`` and the
  LayerNorms, and gather the CLS tokens before the replicated classifier
  (``ViTForImageClassification``).
"""


def hf_policy(model: nn.Module) -> HFPolicy | None:
    """The policy of ``model`` by ``model.config.model_type`` (``None``: not a known family)."""
    model_type = getattr(_config(model), "model_type", None)
    return HF_POLICIES.get(model_type) if isinstance(model_type, str) else None
