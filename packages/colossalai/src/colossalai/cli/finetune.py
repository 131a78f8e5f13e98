"""``colossalai finetune``: LoRA fine-tuning of a model that ``colossalai train`` wrote (a checkpoint
or an ``--export`` folder) or of a Hugging Face causal LM folder, on a corpus of the user's choosing,
with ``train``'s progress, memory and summary, the adapter saved in PEFT's layout and, optionally,
merged into a full folder.

[Note: what finetune reuses]
``finetune`` is ``train`` with the model taken from ``--base`` instead of built fresh: the family,
preset, block size and tokenizer come from the base (a checkpoint's run state, or the
:data:`MODEL_CARD` an export folder holds), the model gets a LoRA adapter
(``Booster.enable_lora``), only the adapter is given to the optimizer, and after boost the base
weights load into the adapted model in place ([Note: a base checkpoint into a LoRA model] in
``colossalai.booster.lora``): every rank reads its own slices, so a base larger than one process
never is whole anywhere. Everything else (plugins, progress, checkpoints and exact resume of the
fine-tuning run, profiling, TensorBoard, the sample) is ``train``'s own code.

A Hugging Face folder (``config.json``, safetensors weights, a ``tokenizer.json``) is built with
``AutoModelForCausalLM.from_config`` and loaded the same way (``Booster.load_pretrained``). Its
``tokenizer.json`` encodes the corpus through ``tokenizers`` whatever its kind: a byte-level BPE
(GPT-2, GPT-NeoX, Llama 3, Qwen, ``train --export`` folders) or a converted SentencePiece model
(Llama 2, Mistral; ``[Note: any tokenizer.json]`` in :mod:`colossalai.data.tokenizer`); the
adapter goes on every linear layer but the output head (``peft``'s ``"all-linear"``) unless
``--lora-targets`` says.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

import torch
from torch import nn

from colossalai.data import CorpusTokenizer

__all__ = [
    "MODEL_CARD",
    "LORA_RANK",
    "BaseModel",
    "add_finetune_arguments",
    "read_base",
    "apply_base",
    "default_targets",
    "lora_config",
    "write_model_card",
    "build_hf",
    "copy_tokenizer_files",
    "frozen_bytes_per_tier",
]

MODEL_CARD = "colossal_model.json"
"""File of an export folder that says which model it holds (family, preset, block size, tokenizer),
so that ``colossalai finetune --base`` can rebuild it."""

LORA_RANK = 8
"""Default LoRA rank ``r`` of ``finetune`` (``lora_alpha`` defaults to ``2 r``)."""

_NOT_TARGETS = ("lm_head", "gate")
"""Linear layers ``finetune`` does not adapt by default: the output head (tied to the embedding in
the GPT) and the MoE router."""


@dataclasses.dataclass(frozen=True)
class BaseModel:
    """The model ``--base`` names: where its weights are and how to rebuild it."""

    path: pathlib.Path
    """The resolved checkpoint folder, or the export folder."""
    kind: str
    """``"checkpoint"`` (``colossalai train --save-dir``), ``"folder"`` (``--export``) or ``"hf"``
    (a Hugging Face folder)."""
    model: str
    """Model family (``--model`` of the base run); ``"hf"`` for a Hugging Face folder."""
    preset: str
    """Preset of the family; the ``model_type`` of a Hugging Face folder."""
    block_size: int
    """Positions of the base model (its ``--seq-len``): fine-tuning windows may not be longer."""
    tokenizer: CorpusTokenizer
    """The base run's tokenizer (the fine-tuning corpus is encoded with it)."""
    hf_config: object = None
    """The ``transformers`` config of a Hugging Face folder (None otherwise)."""
    num_parameters: int = 0
    """Parameters of a Hugging Face folder's model (from its safetensors headers; 0 otherwise)."""


def add_finetune_arguments(p: argparse.ArgumentParser) -> None:
    """Register every ``finetune`` option on ``p``: ``train``'s (but the model, which comes from
    ``--base``) and the LoRA ones."""
    from colossalai.cli.train_args import add_train_arguments

    p.add_argument(
        "--base",
        required=True,
        help="model to fine-tune: a colossalai train checkpoint (or root), --export folder or Hugging Face folder",
    )
    p.add_argument("--lora-rank", type=int, default=LORA_RANK, help=f"LoRA rank r (default {LORA_RANK})")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default 2 x --lora-rank)")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the LoRA input (default 0)")
    p.add_argument(
        "--lora-targets",
        default=None,
        help="comma-separated layer names to adapt (default: every linear layer but the output head and routers)",
    )
    p.add_argument("--adapter-out", default=None, help="write the adapter here in PEFT's layout")
    p.add_argument("--merge-out", default=None, help="write the base with the adapter merged in here (a full folder)")
    add_train_arguments(p, with_model=False)


def _card(folder: pathlib.Path) -> dict | None:
    path = folder / MODEL_CARD
    if not path.is_file():
        return None
    try:
        card = json.loads(path.read_text())
        return {k: card[k] for k in ("model", "preset", "block_size", "tokenizer")}
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a model card of colossalai train --export: {exc}") from None


def read_base(path: str | pathlib.Path) -> BaseModel:
    """What ``--base`` holds: a ``colossalai train`` checkpoint (a step folder, or a root with
    ``latest``), an ``--export`` / ``--merge-out`` folder with its :data:`MODEL_CARD`, or a Hugging
    Face causal LM folder (``config.json``).
    ValueError naming the path and what it holds otherwise."""
    from colossalai.checkpoint import RUN_FILE, load_run_file, resolve_checkpoint
    from colossalai.cli.train_args import seq_len_of
    from colossalai.models import model_family

    path = pathlib.Path(path)
    if not path.is_dir():
        raise ValueError(
            f"--base {path}: no such folder (a colossalai train checkpoint, --export folder or Hugging Face folder)"
        )
    card = _card(path)
    if card is None and (path / "config.json").is_file():
        return _hf_base(path)
    if card is not None:
        tokenizer = CorpusTokenizer.from_json(card["tokenizer"])
        return BaseModel(path, "folder", card["model"], card["preset"], int(card["block_size"]), tokenizer)
    try:
        ckpt = resolve_checkpoint(path)
    except FileNotFoundError as exc:
        raise ValueError(f"--base {path}: {exc}") from None
    if not (ckpt / RUN_FILE).is_file():
        found = sorted(p.name for p in path.iterdir())[:12]
        raise ValueError(
            f"--base {path} is neither a colossalai train checkpoint ({RUN_FILE}), an export folder "
            f"({MODEL_CARD}) nor a Hugging Face folder (config.json); it holds {found}"
        )
    extra = load_run_file(ckpt)["run"].get("extra", {})
    run = extra.get("args", {})
    if "model" not in run:
        raise ValueError(f"--base {ckpt}: the run state does not say which model it trained (not a train checkpoint)")
    saved = extra.get("tokenizer")
    tokenizer = CorpusTokenizer.from_json(saved) if saved else CorpusTokenizer()
    family = model_family(run["model"])
    preset = family.preset(run.get("preset"))
    block = seq_len_of(argparse.Namespace(seq_len=run.get("seq_len")), family.config(preset).block_size)
    if run.get("base"):  # a fine-tuning run's own checkpoint: its base's block size
        block = read_base(run["base"]).block_size
    return BaseModel(ckpt, "checkpoint", run["model"], preset, block, tokenizer)


def _hf_base(path: pathlib.Path) -> BaseModel:
    """A Hugging Face causal LM folder as a base: its config, its ``tokenizer.json``, its size."""
    import transformers

    from colossalai.checkpoint import SafetensorsReader

    try:
        config = transformers.AutoConfig.from_pretrained(str(path))
    except (ValueError, OSError) as exc:
        raise ValueError(f"--base {path}: config.json is not a transformers config: {exc}") from None
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(
            f"--base {path}: a Hugging Face folder needs its tokenizer.json (a slow tokenizer alone, such as a "
            "SentencePiece tokenizer.model, is not read: save the fast tokenizer with transformers first)"
        )
    try:
        tokenizer = CorpusTokenizer(config.vocab_size, tokenizer_file.read_text(encoding="utf-8"))
    except Exception as exc:  # noqa: BLE001  (tokenizers raises a bare Exception for a malformed file)
        raise ValueError(
            f"--base {path}: tokenizer.json is not a tokenizer of at most {config.vocab_size} ids "
            f"(config.vocab_size): {exc}"
        ) from None
    block = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if not block:
        raise ValueError(f"--base {path}: its config gives no positions (n_positions / max_position_embeddings)")
    n = sum(SafetensorsReader(path).held().values())  # elements per tensor, from the headers
    return BaseModel(path, "hf", "hf", config.model_type, int(block), tokenizer, config, n)


def build_hf(base: BaseModel, activation_checkpointing: bool) -> nn.Module:
    """The Hugging Face base's model from its config (random weights: ``load_pretrained`` after boost)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(base.hf_config)
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def copy_tokenizer_files(base: BaseModel, folder) -> None:
    """The tokenizer files of a Hugging Face base into ``folder`` (next to its merged weights)."""
    import shutil

    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")
    for name in names:
        if (base.path / name).is_file():
            shutil.copy2(base.path / name, pathlib.Path(folder) / name)


def apply_base(args: argparse.Namespace) -> BaseModel:
    """Read ``--base`` and set the model options from it (``--model``, ``--preset``,
    ``--vocab-size``, ``--seq-len`` by default the base's block size capped as ``train`` caps it);
    ValueError when ``--seq-len`` exceeds the base's positions."""
    from colossalai.cli.train_args import SEQ_LEN

    base = read_base(args.base)
    args.model, args.preset, args.vocab_size = base.model, base.preset, base.tokenizer.vocab_size
    if args.seq_len is None:
        args.seq_len = min(SEQ_LEN, base.block_size)
    if args.seq_len > base.block_size:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the {base.block_size} positions of --base {args.base}")
    return base


def default_targets(model: nn.Module) -> list[str]:
    """Names (last part) of the linear layers ``finetune`` adapts by default: all but the output
    head and MoE routers, sorted."""
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    return sorted(names - set(_NOT_TARGETS))


def lora_config(args: argparse.Namespace, model: nn.Module):
    """The ``peft.LoraConfig`` of the ``--lora-*`` options for ``model``; ValueError for a rank,
    alpha or dropout out of range."""
    from colossalai.booster.lora import _peft

    peft = _peft()
    if args.lora_rank < 1:
        raise ValueError(f"--lora-rank must be >= 1, got {args.lora_rank}")
    if not 0 <= args.lora_dropout < 1:
        raise ValueError(f"--lora-dropout must lie in [0, 1), got {args.lora_dropout}")
    alpha = 2 * args.lora_rank if args.lora_alpha is None else args.lora_alpha
    if not alpha > 0:
        raise ValueError(f"--lora-alpha must be > 0, got {alpha}")
    if args.lora_targets:
        targets = [t for t in args.lora_targets.split(",") if t]
    elif hasattr(getattr(model, "config", None), "model_type"):  # transformers: peft resolves it
        targets = "all-linear"
    else:
        targets = default_targets(model)
    return peft.LoraConfig(r=args.lora_rank, lora_alpha=alpha, lora_dropout=args.lora_dropout, target_modules=targets)


def write_model_card(folder, model: str, preset: str, block_size: int, tokenizer: CorpusTokenizer) -> pathlib.Path:
    """Write :data:`MODEL_CARD` (and the tokenizer's ``tokenizer.json``) into ``folder``."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    card = {"model": model, "preset": preset, "block_size": block_size, "tokenizer": tokenizer.to_json()}
    (folder / MODEL_CARD).write_text(json.dumps(card, indent=2) + "\n")
    tokenizer.save_hf(folder)
    return folder / MODEL_CARD


def frozen_bytes_per_tier(plugin, frozen_numel: int, precision: str, model=None) -> dict[str, int]:
    """Bytes of frozen (base) weights this process holds, per tier: Gemini's frozen chunk shards by
    the tier their working data is in; under the hybrid plugin the frozen parameters of ``model``
    (the boosted user model: this rank's tensor-parallel blocks); under any other plugin
    ``frozen_numel`` elements in the working precision on the compute device, split over the
    data-parallel ranks by the plugins that shard parameters (ZeRO stage 3, FSDP)."""
    manager = getattr(getattr(plugin, "model", None), "manager", None)
    if manager is not None:
        out: dict[str, int] = {}
        for chunk in manager.chunks:
            if chunk.frozen:
                out[chunk.w_tier] = out.get(chunk.w_tier, 0) + chunk.shard_nbytes
        return out
    from colossalai.booster.fsdp_plugin import TorchFSDPPlugin
    from colossalai.cli.headline import working_bytes

    if getattr(plugin, "name", None) == "hybrid" and model is not None:
        local = {id(p): p for p in model.parameters() if not p.requires_grad and not p.is_meta}
        return {torch.device(plugin.device).type: sum(p.numel() * p.element_size() for p in local.values())}
    sharded = getattr(plugin, "stage", 0) == 3 or isinstance(plugin, TorchFSDPPlugin)
    shards = plugin.dp_size() if sharded else 1
    return {torch.device(plugin.device).type: frozen_numel * working_bytes(precision) // shards}
