"""LoRA fine-tuning through the Booster: ``peft`` adapters trained under any plugin, saved and
loaded in PEFT's own folder layout (``adapter_config.json`` + ``adapter_model.safetensors``).

[Note: an adapter folder as a partial checkpoint]
An adapter folder holds only the adapter's tensors, under the names
``peft.get_peft_model_state_dict`` gives them (the adapter name ``.default`` left out). Which model
entries those are, and under which file name each is saved, is asked of ``peft`` itself: the
model's entries (:meth:`Plugin.checkpoint_entries`: logical shapes, so nothing is gathered and a
ZeRO-3 model's freed parameters do not matter) become meta tensors, ``get_peft_model_state_dict``
picks and renames some of them, and the identity of each picked tensor gives back its model name.
Loading is then an ordinary flat-slice load (``[Note: flat-slice checkpoints]``) of a reader that
holds the (small) adapter tensors whole in memory, with every other entry in ``reader.skip``: each
plugin's ``load_checkpoint_pieces`` leaves skipped entries as they are, so DDP, ZeRO, Gemini, FSDP
and the hybrid plugin need nothing new and the base weights are never reported missing.

[Note: a base checkpoint into a LoRA model]
``peft`` renames what it wraps: ``transformer.h.0.attn.c_attn.weight`` of the base model is
``base_model.model.transformer.h.0.attn.c_attn.base_layer.weight`` in the PeftModel. The Booster
builds and boosts the LoRA model first and loads weights after (a model larger than one process is
never whole anywhere), so a checkpoint of the base model (``save_model``/``save_run`` of a run
without LoRA, or a Hugging Face folder) must load into the PeftModel's names. :func:`base_entry_names`
maps each entry of the PeftModel back to its base name (the ``base_model.model.`` prefix and peft's
``base_layer`` / ``original_module`` / ``modules_to_save.<adapter>`` segments dropped); the adapter's
own entries are left as they are. The checkpoint is compared with the base names (so an error names
what the user's checkpoint holds) and read through a :class:`~colossalai.checkpoint.renamed.RenamedReader`
([Note: a renamed reader]), each rank reading only its own slices as in any other load; a
``modules_to_save`` copy is filled from the same base tensor as its original.
"""

from __future__ import annotations

import copy
import math
import pathlib
import re
import sys
import types
import weakref

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from colossal.comm.checkpoint import compare_entries, piece_index
from colossalai.checkpoint import CheckpointMismatchError, IncompatibleEntries, SliceReader
from colossalai.checkpoint.errors import unreadable
from colossalai.checkpoint.renamed import RenamedReader

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "enable_lora",
    "check_peft_model",
    "adapter_keys",
    "save_adapter",
    "load_adapter",
    "is_peft_model",
    "base_entry_names",
    "load_base",
    "load_base_pretrained",
    "merged_state_dict",
    "adapter_names",
    "gather_entries",
]

ADAPTER_CONFIG = "adapter_config.json"
"""The adapter's ``PeftConfig`` (``PeftConfig.save_pretrained`` writes it)."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""The adapter's tensors, named as ``peft.get_peft_model_state_dict`` names them."""
_SHOWN = 8  # names listed in an error message


def _peft():
    try:
        import peft
    except ImportError as e:
        raise ImportError("LoRA through the Booster needs peft: pip install 'colossal-stack[lora]'") from e
    return peft


def enable_lora(model: nn.Module, lora_config=None):
    """``peft.get_peft_model(model, lora_config)`` after checking that the config fits the model, or
    ``model`` itself when it already is a ``peft.PeftModel`` (checked by :func:`check_peft_model`).
    Local and deterministic (no collective): every rank raises alike. ``TypeError`` for a config
    that is not a ``peft.LoraConfig``; ``ValueError`` for targets that match no module, a rank
    larger than a targeted layer allows, or base parameters left trainable."""
    peft = _peft()
    if isinstance(model, peft.PeftModel):
        if lora_config is not None:
            raise ValueError("model is already a peft.PeftModel (it has its adapter): pass lora_config=None")
        check_peft_model(model)
        return model
    if not isinstance(lora_config, peft.LoraConfig):
        raise TypeError(f"lora_config must be a peft.LoraConfig, got {type(lora_config).__name__}")
    _check_targets(model, lora_config)
    peft_model = peft.get_peft_model(model, lora_config)
    try:
        check_peft_model(peft_model)
    except ValueError:
        peft_model.unload()  # the user's model as it was (get_peft_model injects the layers in place)
        raise
    return peft_model


def _check_targets(model: nn.Module, config) -> None:
    """ValueError when ``config.target_modules`` match no module of ``model`` (matched as ``peft``
    matches them). ``None`` and ``"all-linear"`` are resolved by ``peft`` from the model type."""
    from peft.tuners.tuners_utils import check_target_module_exists

    targets = config.target_modules
    if targets is None or targets == "all-linear":
        return
    names = [n for n, _ in model.named_modules() if n]
    if not any(check_target_module_exists(config, n) for n in names):
        leaves = [n for n, m in model.named_modules() if n and not list(m.children())]
        patterns = sorted(targets) if isinstance(targets, set | list | tuple) else targets
        raise ValueError(
            f"lora_config.target_modules={patterns!r} match no module of {type(model).__name__}; "
            f"its modules include {leaves[:_SHOWN]} (a name matches when it ends with a listed name, "
            "or, for a string, when the whole name matches the regular expression)"
        )


def check_peft_model(model) -> None:
    """Check a ``peft.PeftModel`` before it is boosted: one active LoRA adapter, a rank no larger
    than ``min(in_features, out_features)`` of each adapted layer, and no trainable parameter
    outside the adapter (and its ``modules_to_save``). ValueError naming the values otherwise."""
    peft = _peft()
    config = model.active_peft_config
    if not isinstance(config, peft.LoraConfig) or not isinstance(model.active_adapter, str):
        kind = getattr(config, "peft_type", type(config).__name__)
        raise NotImplementedError(f"the Booster trains one LoRA adapter (peft.LoraConfig), got {kind}")
    _check_ranks(model, model.active_adapter)
    _check_frozen(model)


def _check_ranks(model, adapter: str) -> None:
    from peft.tuners.lora import LoraLayer

    for name, layer in model.named_modules():
        r = layer.r.get(adapter) if isinstance(layer, LoraLayer) else None
        if r is not None and r > min(layer.in_features, layer.out_features):
            shape = (layer.in_features, layer.out_features)
            raise ValueError(
                f"LoRA rank r={r} is larger than min(in_features, out_features) of {name!r} "
                f"(in_features, out_features = {shape}): use r <= {min(shape)} (or a rank_pattern for that layer)"
            )


def _check_frozen(model) -> None:
    state = model.state_dict(keep_vars=True)  # the parameters themselves: identity tells them apart
    adapter = set(adapter_keys(model, state)) - set(_adapted_embeddings(model))  # embeddings stay frozen
    stray = [n for n, p in model.named_parameters() if p.requires_grad and n not in adapter]
    if stray:
        raise ValueError(
            f"{len(stray)} base parameter(s) of the PeftModel still require grad, e.g. {stray[:_SHOWN]}: "
            "LoRA trains the adapter only. Freeze them (p.requires_grad_(False)), or list their modules in "
            "LoraConfig(modules_to_save=[...]) to train and save them with the adapter"
        )


_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""PeftModel -> (adapter, ``model name -> file name``) as :func:`adapter_keys` found them before
boost: ``peft`` calls ``state_dict()`` of each ``modules_to_save`` copy to list its names, which a
ZeRO stage-3 model refuses for a part of itself (its parameters are placeholders there)."""


def adapter_keys(model, state: dict[str, torch.Tensor]) -> dict[str, str]:
    """``model name -> file name`` of the adapter entries of ``state`` (the PeftModel's names, any
    tensors: meta ones will do), as ``peft.get_peft_model_state_dict`` picks and names them for the
    active adapter ([Note: an adapter folder as a partial checkpoint]). Remembered per model and
    adapter from the first call (:func:`enable_lora` makes it before boost)."""
    from peft import get_peft_model_state_dict

    known = _KEYS.get(model)
    if known is not None and known[0] == model.active_adapter:
        return {n: k for n, k in known[1].items() if n in state}
    picked = get_peft_model_state_dict(
        model, state_dict=state, adapter_name=model.active_adapter, save_embedding_layers=False
    )
    name_of = {id(t): n for n, t in state.items()}
    keys = {name_of[id(t)]: key for key, t in picked.items()}
    keys.update({n: n for n in _adapted_embeddings(model) if n in state})
    _KEYS[model] = (model.active_adapter, keys)
    return keys


def _adapted_embeddings(model) -> list[str]:
    """Names of the base weights of the embedding layers the active adapter adapts: ``peft``'s
    ``save_embedding_layers="auto"`` saves them whole with the adapter (under these names) when an
    embedding is a LoRA target, so a folder holds the embedding its ``lora_embedding_*`` belong to.
    (Its other trigger, a vocabulary resized since the hub's config, asks the hub: not followed.)"""
    from peft.tuners.lora import LoraLayer

    adapter = model.active_adapter
    return [
        f"{name}.base_layer.weight"
        for name, layer in model.named_modules()
        if isinstance(layer, LoraLayer) and adapter in layer.lora_embedding_A
    ]


def save_adapter(model, full: dict[str, torch.Tensor], folder) -> pathlib.Path:
    """Write PEFT's folder layout from ``full`` (the gathered state of the PeftModel ``model``):
    the adapter config (``inference_mode=True``, as ``PeftModel.save_pretrained`` writes it) and
    the adapter tensors under PEFT's names, contiguous, on the CPU. Not collective (rank 0 calls it)."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        key: full[name].detach().to("cpu").contiguous().clone() for name, key in adapter_keys(model, full).items()
    }
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = copy.deepcopy(model.active_peft_config)
    config.inference_mode = True
    base = model.get_base_model()
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = base.__dict__.get("name_or_path") or None
    mapping = None  # without a task type peft records the base class to rebuild (PeftModel.save_pretrained)
    if config.task_type is None:
        mapping = {"base_model_class": type(base).__name__, "parent_library": type(base).__module__}
    config.save_pretrained(str(folder), auto_mapping_dict=mapping)
    return folder


def _read_header(path: pathlib.Path) -> dict[str, tuple[tuple[int, ...], str]]:
    if not path.is_file():
        found = sorted(p.name for p in path.parent.iterdir()) if path.parent.is_dir() else []
        raise FileNotFoundError(
            f"{str(path.parent)!r} is not a PEFT adapter folder: expected {ADAPTER_WEIGHTS}, found {found[:12]} "
            "(save the adapter with safe_serialization=True)"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118
    except Exception as e:
        raise unreadable(path, "the adapter file", e) from e


_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}  # fmt: skip
"""safetensors' dtype names -> torch's (as the entry tables record them)."""


def load_adapter(plugin, model: nn.Module, folder, *, strict: bool = True) -> IncompatibleEntries:
    """Load an adapter folder (PEFT's layout) into ``model``, the plugin's wrapped PeftModel, as a
    partial flat-slice load ([Note: an adapter folder as a partial checkpoint]). Strict: missing,
    unexpected and mis-shaped adapter entries (``model/<name in the file>``) are one
    :class:`~colossalai.checkpoint.CheckpointMismatchError` before anything changes; with
    ``strict=False`` the missing stay, the unexpected are ignored, and both are returned.
    Collective (the plugin's load is): every rank calls it."""
    path = pathlib.Path(folder) / ADAPTER_WEIGHTS
    user = plugin.unwrap(model)
    if not isinstance(user, _peft().PeftModel):
        raise TypeError(f"load_lora needs a model boosted after Booster.enable_lora, got {type(user).__name__}")
    entries = plugin.checkpoint_entries(model)  # model/<name> -> (shape, dtype): nothing gathered
    names = {key: name for name, key in adapter_keys(user, _meta(entries)).items()}  # file name -> model name
    header = _read_header(path)
    saved = {f"model/{k}": (s, _DTYPE_NAMES.get(d, d)) for k, (s, d) in header.items()}
    expected = {f"model/{key}": entries[f"model/{name}"] for key, name in names.items()}
    found = compare_entries(saved, {k: math.prod(s) for k, (s, _) in saved.items()}, expected, with_optimizer=False)
    if found.mismatched or (strict and found):
        hint = "" if found.mismatched else "pass strict=False to load the adapter entries that match"
        raise CheckpointMismatchError(path, found, hint)
    reader = _AdapterReader(path, {names[k]: k for k in header if k in names})
    reader.skip = {e for e in entries if e.removeprefix("model/") not in reader.loaded}  # the base, the missing
    plugin.load_checkpoint_pieces(model, None, reader)
    return found


class _AdapterReader(SliceReader):
    """The adapter file's tensors through the :class:`~colossalai.checkpoint.SliceReader` interface:
    each a whole piece ``model/<model name>@0`` (0-dim: ``model/<name>``), read whole on every rank
    (an adapter is small) and copied out of memory, so no collective read is needed."""

    def __init__(self, path: pathlib.Path, files: dict[str, str]) -> None:  # noqa: D107 (no DCP folder: no super())
        self.path = str(path)
        with safe_open(self.path, framework="pt") as f:
            whole = {name: f.get_tensor(key) for name, key in files.items()}
        self.loaded = set(whole)  # model names this reader fills
        self.tensors = {
            f"model/{n}@0" if t.dim() else f"model/{n}": t.reshape(-1) if t.dim() else t for n, t in whole.items()
        }
        meta = lambda t: types.SimpleNamespace(size=t.shape, properties=types.SimpleNamespace(dtype=t.dtype))  # noqa: E731
        self.metadata = {k: meta(t) for k, t in self.tensors.items()}
        self.pieces = piece_index(self.metadata)
        self.skip: set[str] = set()
        self.read_keys: list[str] = []
        self.read_numel = 0

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Fill ``tensors`` (keys of :attr:`metadata`) from memory. Not collective."""
        self.read_keys += list(tensors)
        self.read_numel += sum(t.numel() for t in tensors.values())
        for key, t in tensors.items():
            t.copy_(self.tensors[key])


# ---- a base model's checkpoint into a LoRA model ([Note: a base checkpoint into a LoRA model]) ----
_WRAPPERS = re.compile(r"\.(?:base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")
_PEFT_PREFIX = "base_model.model."


def is_peft_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``peft.PeftModel`` (False without importing peft when it is not loaded)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def _meta(entries: dict) -> dict[str, torch.Tensor]:
    """Meta tensors of a plugin's ``checkpoint_entries`` under the model's names."""
    return {
        k.removeprefix("model/"): torch.empty(s, dtype=getattr(torch, d), device="meta")
        for k, (s, d) in entries.items()
    }


def adapter_names(user, entries: dict) -> list[str]:
    """Model names of the adapter's entries (what :func:`save_adapter` writes) among ``entries``."""
    return sorted(adapter_keys(user, _meta(entries)))


def gather_entries(plugin, model: nn.Module, names, entries: dict | None = None) -> dict[str, torch.Tensor] | None:
    """The model entries ``names``, whole, on the CPU of rank 0 (None on the other ranks): each rank
    sends its own pieces of them (:meth:`Plugin.model_pieces`) and rank 0 joins them, so only these
    entries travel and rank 0 never holds the rest of the model (an adapter, not its base).
    ``entries``: the plugin's ``checkpoint_entries(model)`` when the caller has them (they are read
    on every rank: collective under some plugins). RuntimeError when the pieces do not cover an
    entry. Collective: every rank calls it."""
    import torch.distributed as dist

    names = list(names)
    entries = plugin.checkpoint_entries(model) if entries is None else entries
    mine = {k: v.detach().to("cpu").clone() for k, v in plugin.model_pieces(model, names).items()}  # no views
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    parts = [None] * world if rank == 0 else None
    if world > 1:
        dist.gather_object(mine, parts, dst=0)
    else:
        parts = [mine]
    if rank != 0:
        return None
    flats: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for key, t in part.items():
            prefix, _, start = key.rpartition("@")
            if not prefix:  # a 0-dim entry
                out[key.removeprefix("model/")] = t
                continue
            name = prefix.removeprefix("model/")
            n = math.prod(entries[prefix][0])
            flat = flats.setdefault(name, torch.empty(n, dtype=t.dtype))
            seen = covered.setdefault(name, torch.zeros(n, dtype=torch.bool))
            flat[int(start) : int(start) + t.numel()] = t
            seen[int(start) : int(start) + t.numel()] = True
    for name in names:
        if name in out:
            continue
        if name not in flats or not covered[name].all():
            have = int(covered[name].sum()) if name in covered else 0
            raise RuntimeError(f"the ranks' pieces of {name!r} cover {have} of its elements, not all")
        out[name] = flats[name].view(entries[f"model/{name}"][0])
    return out


def base_entry_names(user, entries: dict) -> tuple[dict[str, str], set[str]]:
    """``(names, adapter)`` for the entries (``model/<name>`` keys) of the PeftModel ``user``:
    ``names`` maps each entry that holds base weights (and each ``modules_to_save`` copy) to the
    base model's entry; ``adapter`` is the set of the adapter's own entries."""
    meta = _meta(entries)
    own = adapter_keys(user, meta)
    names, adapter = {}, set()
    for key in entries:
        name = key.removeprefix("model/")
        if name in own and ".lora_" in name:  # the adapter's own (not a modules_to_save copy, an embedding)
            adapter.add(key)
        else:
            names[key] = "model/" + _WRAPPERS.sub("", name.removeprefix(_PEFT_PREFIX))
    return names, adapter


def holds_base_names(saved: dict) -> bool:
    """Whether a checkpoint's entries are a base model's (no entry under the PeftModel's prefix)."""
    return not any(k.startswith(f"model/{_PEFT_PREFIX}") for k in saved)


def _base_load(plugin, model: nn.Module, view_of) -> IncompatibleEntries:
    user = plugin.unwrap(model)
    entries = plugin.checkpoint_entries(model)
    names, adapter = base_entry_names(user, entries)
    expected = {old: entries[new] for new, old in names.items()}
    inner, found = view_of(expected)
    view = RenamedReader(inner, names)
    view.skip = adapter | {new for new, old in names.items() if old in inner.skip}
    plugin.load_checkpoint_pieces(model, None, view)
    return found


def load_base(plugin, model: nn.Module, reader, *, strict: bool = True) -> IncompatibleEntries:
    """Load ``reader`` (a flat-slice checkpoint of the base model) into ``model``, the plugin's
    wrapped PeftModel; the adapter is left as it is ([Note: a base checkpoint into a LoRA model]).
    Strict over the base entries, named as the checkpoint names them. Collective."""
    from colossal.comm.checkpoint import fit_entries

    def view_of(expected):
        return reader, fit_entries(reader, expected, with_optimizer=False, strict=strict)

    return _base_load(plugin, model, view_of)


def load_base_pretrained(plugin, model: nn.Module, folder, *, strict: bool = True) -> IncompatibleEntries:
    """Load a Hugging Face folder of the base model into ``model``, the plugin's wrapped PeftModel
    (names matched against the base model as ``from_pretrained`` matches them); the adapter is left
    as it is. Strict over the base entries. Collective."""
    from colossalai.checkpoint.hf import pretrained_reader

    base = plugin.unwrap(model).get_base_model()
    return _base_load(plugin, model, lambda expected: pretrained_reader(folder, base, expected, strict=strict))


# ---- merging the adapter into the base weights -----------------------------------------------------
def merged_state_dict(user, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's state dict with the adapter merged in, from ``full`` (the gathered state of
    the PeftModel ``user``): each adapted weight ``W + scaling * B @ A`` (transposed for a
    ``fan_in_fan_out`` layer, as GPT-2's ``Conv1D``; ``(B @ A)^T`` for an embedding), computed in
    fp32 and stored in ``W``'s dtype; a ``modules_to_save`` module's trained copy in place of its
    original; names as the base model has them. ``NotImplementedError`` for adapters this formula
    does not cover (DoRA, a LoRA bias, convolutions). Not collective."""
    from peft.tuners.lora import Embedding, Linear, LoraLayer

    adapter = user.active_adapter
    out = {}
    merged = {}
    for name, layer in user.named_modules():
        if not isinstance(layer, LoraLayer) or (adapter not in layer.lora_A and adapter not in layer.lora_embedding_A):
            continue
        if layer.use_dora.get(adapter) or getattr(layer, "lora_bias", {}).get(adapter):
            raise NotImplementedError(f"merging {name!r}: DoRA and LoRA biases are not merged yet (plain LoRA is)")
        if isinstance(layer, Linear):
            a, b = full[f"{name}.lora_A.{adapter}.weight"], full[f"{name}.lora_B.{adapter}.weight"]
            delta = b.float() @ a.float()
            delta = delta.T if layer.fan_in_fan_out else delta
        elif isinstance(layer, Embedding):
            a, b = full[f"{name}.lora_embedding_A.{adapter}"], full[f"{name}.lora_embedding_B.{adapter}"]
            delta = (b.float() @ a.float()).T
        else:
            raise NotImplementedError(f"merging {name!r}: {type(layer).__name__} layers are not merged yet")
        merged[f"{name}.base_layer.weight"] = delta * layer.scaling[adapter]
    for name, t in full.items():
        if ".lora_" in name or (".original_module." in name and _has_copy(name, full)):
            continue
        if name in merged:
            t = (t.float() + merged[name].to(t.device)).to(t.dtype)
        out[_WRAPPERS.sub("", name.removeprefix(_PEFT_PREFIX))] = t
    return out


def _has_copy(name: str, full: dict) -> bool:
    """Whether a ``modules_to_save`` original has its trained copy in ``full`` (which replaces it)."""
    head, _, tail = name.partition(".original_module.")
    return any(k.startswith(f"{head}.modules_to_save.") and k.endswith(f".{tail}") for k in full)
