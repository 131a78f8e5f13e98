"""Export to (and read back) a Hugging Face style safetensors folder.

Layout: ``model-00001-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``
(``{"metadata": {"total_size": bytes}, "weight_map": {name: shard}}``), exactly what
``transformers`` writes, so the folder loads with ``safetensors.torch.load_file`` per shard.
"""

from __future__ import annotations

import json
import os
import pathlib

import torch
from safetensors.torch import load_file, save_file

from colossalai.checkpoint.errors import unreadable
from colossalai.checkpoint.integrity import load_file_checked

__all__ = ["save_safetensors_folder", "load_safetensors_folder", "INDEX_NAME"]

INDEX_NAME = "model.safetensors.index.json"
"""Name of the index file."""


def _plan_shards(state: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def save_safetensors_folder(
    state: dict[str, torch.Tensor], folder: str | os.PathLike, max_shard_bytes: int = 2 * 1024**3
) -> pathlib.Path:
    """Write ``state`` (full tensors) as safetensors shards of at most ``max_shard_bytes`` + index.

    Tensors that share storage (tied weights) are written as separate copies, so every name in
    the model's ``state_dict`` is present and ``load_state_dict(strict=True)`` works.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
    shards = _plan_shards(state, max_shard_bytes)
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: state[n] for n in names}, str(folder / fname), metadata={"format": "pt"})
        for n in names:
            weight_map[n] = fname
            total += state[n].numel() * state[n].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return folder


def load_safetensors_folder(folder: str | os.PathLike, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Read every tensor named in the index back into one state dict."""
    folder = pathlib.Path(folder)
    index_path = folder / INDEX_NAME
    if not index_path.is_file():
        raise FileNotFoundError(f"{index_path} not found; is {str(folder)!r} a safetensors export?")
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise unreadable(index_path, "the safetensors index", e) from e
    state: dict[str, torch.Tensor] = {}
    for fname in sorted(set(weight_map.values())):
        shard = load_file_checked(folder / fname, "the safetensors shard", lambda p: load_file(str(p), device=device))
        state.update(shard)
    missing = sorted(n for n, f in weight_map.items() if n not in state)
    if missing:
        raise unreadable(index_path, "the safetensors index", KeyError(f"names {missing[:8]} are in no shard"))
    return state
