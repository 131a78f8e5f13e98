"""Checkpoints: sharded (DCP, reshardable across plugins and world sizes), strict (every entry's
shape and dtype checked), verified (checksums), crash-safe directories, whole-run state, and
Hugging Face style safetensors export, and Hugging Face ``save_pretrained`` folders in and out."""

from colossalai.checkpoint.atomic import LATEST, atomic_checkpoint_dir, read_latest, resolve_checkpoint
from colossalai.checkpoint.errors import CheckpointError, CheckpointMismatchError, IncompatibleEntries
from colossalai.checkpoint.guard import DEFAULT_ARRIVAL_TIMEOUT, arrival_checked, check_all_ranks_arrive
from colossalai.checkpoint.hf import SafetensorsReader, load_pretrained, parse_shard_size, save_pretrained
from colossalai.checkpoint.run_state import (
    RUN_FILE,
    capture_rng,
    load_rng,
    load_run_file,
    read_rng,
    restore_rng,
    save_rng,
    save_run_files,
)
from colossalai.checkpoint.safetensors_io import INDEX_NAME, load_safetensors_folder, save_safetensors_folder
from colossalai.checkpoint.sharded import load_sharded, save_sharded
from colossalai.checkpoint.slices import GROUPS_KEY, SliceReader

__all__ = [
    "LATEST",
    "atomic_checkpoint_dir",
    "read_latest",
    "resolve_checkpoint",
    "CheckpointError",
    "CheckpointMismatchError",
    "IncompatibleEntries",
    "DEFAULT_ARRIVAL_TIMEOUT",
    "check_all_ranks_arrive",
    "arrival_checked",
    "RUN_FILE",
    "capture_rng",
    "restore_rng",
    "save_rng",
    "save_run_files",
    "load_rng",
    "read_rng",
    "load_run_file",
    "INDEX_NAME",
    "save_safetensors_folder",
    "load_safetensors_folder",
    "save_sharded",
    "load_sharded",
    "SliceReader",
    "GROUPS_KEY",
    "SafetensorsReader",
    "load_pretrained",
    "save_pretrained",
    "parse_shard_size",
]
