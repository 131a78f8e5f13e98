"""Flat-slice checkpoints of the sharded plugins: a ZeRO-3 / Gemini save on 2 ranks writes per-rank
pieces whose sizes sum to the model (no rank hands DCP the whole model), and a load on 4 ranks reads
only the pieces that overlap what each rank owns, then trains on with the losses of an
uninterrupted run (1e-5 relative, fp32: see test_colossalai_checkpoint.py). A checkpoint with a
piece missing is refused on every rank from its metadata.
"""

import collections
import pathlib
import shutil

import pytest
import torch
from colossalai_harness import GLOBAL_BATCH, boosted_losses, boosted_setup, reference_losses
from torch.distributed.checkpoint import FileSystemReader

from colossal.comm.testing import run_distributed
from colossalai import RunState
from colossalai.booster.registry import make_plugin
from colossalai.checkpoint import CheckpointError, SliceReader
from colossalai.models import build_gpt

SAVE_AT, TOTAL = 2, 4
MODEL_NUMEL = sum(p.numel() for p in build_gpt("tiny", block_size=32, seed=0).parameters())  # tied: once


def _plugin(spec: str):
    return make_plugin("zero", stage=3) if spec == "zero3" else make_plugin(spec)


def _numel(pieces: dict, prefix: str) -> int:
    return sum(t.numel() for k, t in pieces.items() if k.startswith(prefix) and "@" in k)


def _save(spec: str, root: str):
    booster, model, optim, loader = boosted_setup(_plugin(spec))
    losses = boosted_losses(booster, model, optim, loader, SAVE_AT)
    pieces = booster.plugin.checkpoint_pieces(model.module, optim.unwrap())  # what save_run hands DCP
    booster.save_run(root, model, optim, state=RunState(step=SAVE_AT, consumed_samples=SAVE_AT * GLOBAL_BATCH))
    return losses, _numel(pieces, "model/"), _numel(pieces, "optim/")


def _owned(plugin) -> list[tuple[str, int, int]]:
    """``(parameter name, first element, end)`` of every slice this rank owns."""
    if plugin.name == "zero":
        return [
            (f.names[s.index], s.param_start, s.param_start + s.numel) for f in plugin.engine.flats for s in f.slices()
        ]
    m, out = plugin.model.manager, []
    for chunk in m.chunks:
        lo, hi = chunk.shard_range(m.rank)
        for info in chunk.tensors:
            a, b = max(lo, info.offset), min(hi, info.offset + info.numel)
            if a < b:
                out.append((info.name, a - info.offset, b - info.offset))
    return out


def _resume(spec: str, root: str):
    import colossal.comm.checkpoint.flat as flat  # open_reader() builds the reader the Booster uses

    readers = []

    class Recording(SliceReader):
        def __init__(self, path, **dcp_kwargs):
            super().__init__(path, **dcp_kwargs)
            readers.append(self)

    flat.SliceReader = Recording
    booster, model, optim, loader = boosted_setup(_plugin(spec))
    state = booster.load_run(root, model, optim, dataloader=loader)
    reader = readers[0]
    read = [k for k in reader.read_keys if k.startswith("model/")]
    owned = _owned(booster.plugin)
    for key in read:  # every piece read overlaps a slice this rank owns
        prefix, start = key.rsplit("@", 1)
        lo, hi = int(start), int(start) + reader.metadata[key].size[0]
        assert any(f"model/{n}" == prefix and a < hi and lo < b for n, a, b in owned), key
    losses = boosted_losses(booster, model, optim, loader, TOTAL, start=state.step)
    return losses, sum(reader.metadata[k].size[0] for k in read), sum(b - a for _, a, b in owned), read


@pytest.mark.parametrize("spec", ["zero3", "gemini"])
def test_sharded_save_writes_slices_and_resharded_load_reads_overlaps(tmp_path, spec):
    saved = run_distributed(_save, 2, spec, str(tmp_path), timeout=120)
    model_numels = [m for _, m, _ in saved]
    assert sum(model_numels) == MODEL_NUMEL and max(model_numels) < 0.75 * MODEL_NUMEL, model_numels
    assert sum(o for *_, o in saved) == 2 * MODEL_NUMEL  # AdamW: exp_avg + exp_avg_sq, sliced the same way
    meta = FileSystemReader(str(next(tmp_path.glob("step-*")) / "dcp")).read_metadata()
    per_file = collections.Counter()
    for index, info in meta.storage_data.items():
        if index.fqn.startswith("model/"):
            per_file[pathlib.Path(info.relative_path).name] += info.length
    assert len(per_file) == 2 and max(per_file.values()) < 0.75 * sum(per_file.values()), per_file

    resumed = run_distributed(_resume, 4, spec, str(tmp_path), timeout=180)
    losses = saved[0][0] + resumed[0][0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses(TOTAL)), rtol=1e-5, atol=0)
    owned = [o for _, _, o, _ in resumed]
    assert sum(owned) == MODEL_NUMEL, owned
    read = [r for _, r, _, _ in resumed]
    assert all(r < MODEL_NUMEL for r in read), read  # no rank reads the whole model
    all_model_keys = {k for k in meta.state_dict_metadata if k.startswith("model/")}
    assert set().union(*(keys for *_, keys in resumed)) == all_model_keys
    print(f"{spec}: saved model elements per rank {model_numels}, read per rank {read} of {MODEL_NUMEL}")


def test_fsdp_ranks_write_their_rows(tmp_path):
    saved = run_distributed(_save, 2, "fsdp", str(tmp_path), timeout=120)
    model_numels = [m for _, m, _ in saved]
    assert sum(model_numels) == MODEL_NUMEL and max(model_numels) < 0.75 * MODEL_NUMEL, model_numels
    assert sum(o for *_, o in saved) == 2 * MODEL_NUMEL


def _load_damaged(root: str):
    booster, model, optim, _ = boosted_setup(_plugin("zero3"))
    with pytest.raises(CheckpointError, match="overlap or leave a gap|holds"):
        booster.load_run(root, model, optim)
    return True


def test_damaged_checkpoint_raises_on_every_rank(tmp_path):
    """A checkpoint missing one piece is refused from its metadata on every rank (no hang, no zeros).
    The rewritten ``.metadata`` no longer matches its checksum; drop the checksums (a checkpoint
    from before they existed) to reach the piece check."""
    run_distributed(_save, 2, "zero3", str(tmp_path), timeout=120)
    path = str(next(tmp_path.glob("step-*")) / "dcp")
    reader = FileSystemReader(path)
    meta = reader.read_metadata()
    starts = collections.Counter(k.rsplit("@", 1)[0] for k in meta.state_dict_metadata if k.startswith("model/"))
    victim = next(f"{p}@0" for p, n in starts.items() if n > 1)  # a parameter split over the 2 ranks
    del meta.state_dict_metadata[victim]
    import pickle

    with open(pathlib.Path(path) / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    shutil.rmtree(pathlib.Path(path) / "checksums")
    assert run_distributed(_load_damaged, 2, str(tmp_path), timeout=120) == [True, True]
