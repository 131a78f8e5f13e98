"""Checkpoints: sharded (DCP, reshardable across plugins and world sizes), crash-safe directories,
whole-run state, and Hugging Face style safetensors export."""

from colossalai.checkpoint.atomic import LATEST, atomic_checkpoint_dir, read_latest, resolve_checkpoint
from colossalai.checkpoint.run_state import RUN_FILE, capture_rng, load_rng, restore_rng, save_rng
from colossalai.checkpoint.safetensors_io import INDEX_NAME, load_safetensors_folder, save_safetensors_folder
from colossalai.checkpoint.sharded import load_sharded, save_sharded
from colossalai.checkpoint.slices import GROUPS_KEY, SliceReader

__all__ = [
    "LATEST",
    "atomic_checkpoint_dir",
    "read_latest",
    "resolve_checkpoint",
    "RUN_FILE",
    "capture_rng",
    "restore_rng",
    "save_rng",
    "load_rng",
    "INDEX_NAME",
    "save_safetensors_folder",
    "load_safetensors_folder",
    "save_sharded",
    "load_sharded",
    "SliceReader",
    "GROUPS_KEY",
]
