"""A truncated or corrupted checkpoint file raises an ordinary exception (CheckpointError, caught by
``except Exception``) naming the file and what to do, before the model changes: DCP shards and
``.metadata`` (truncated, or one byte flipped: the checksums catch what DCP would load silently),
the run state, the RNG states, safetensors shards and their index. On 2 ranks every rank raises."""

import pathlib
import shutil

import pytest
import torch
from torch import nn

from colossal.comm.testing import run_distributed
from colossalai import Booster, RunState
from colossalai.booster.registry import make_plugin
from colossalai.checkpoint import INDEX_NAME, CheckpointError, load_safetensors_folder


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    booster = Booster(plugin=make_plugin("ddp"))
    model = nn.Sequential(nn.Linear(4, 64), nn.BatchNorm1d(64), nn.Linear(64, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optim, *_ = booster.boost(model, optim)
    booster.backward(model(torch.randn(8, 4)).sum(), optim)
    optim.step()
    return booster, model, optim


def _truncate(path: pathlib.Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {"truncated": _truncate, "flipped": _flip}
FILES = {  # file kind -> path inside a save_run checkpoint
    "dcp shard": "dcp/__0_0.distcp",
    ".metadata": "dcp/.metadata",
    "run state": "run_state.pt",
    "rng state": "rng/rank0.pt",
}


def _params(model) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.module.state_dict().values()]


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("kind", list(FILES))
def test_damaged_run_checkpoint_raises_naming_the_file(tmp_path, kind, damage):
    booster, model, optim = _setup()
    ckpt = booster.save_run(tmp_path, model, optim, state=RunState(step=1))
    DAMAGE[damage](ckpt / FILES[kind])
    booster2, model2, optim2 = _setup(seed=1)
    before = _params(model2)
    with pytest.raises(CheckpointError) as err:
        booster2.load_run(tmp_path, model2, optim2)
    assert isinstance(err.value, Exception)  # not a BaseException that `except Exception` misses
    assert str(ckpt / FILES[kind]) in str(err.value) and err.value.path == str(ckpt / FILES[kind]), err.value
    assert "older checkpoint" in str(err.value) or "incomplete" in str(err.value), err.value
    assert all(torch.equal(a, b) for a, b in zip(before, _params(model2), strict=True))  # nothing changed


def test_damaged_metadata_without_checksums(tmp_path):
    """A checkpoint from before checksums existed: the unpickling error becomes a CheckpointError."""
    booster, model, optim = _setup()
    ckpt = booster.save_model(model, tmp_path)
    shutil.rmtree(ckpt / "dcp" / "checksums")
    _truncate(ckpt / "dcp" / ".metadata")
    with pytest.raises(CheckpointError, match=r"\.metadata"):
        booster.load_model(model, ckpt)


def test_missing_shard_raises(tmp_path):
    booster, model, optim = _setup()
    ckpt = booster.save_model(model, tmp_path)
    (ckpt / "dcp" / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match="__0_0.distcp.*missing"):
        booster.load_model(model, ckpt)


@pytest.mark.parametrize("what", ["shard", "index"])
def test_damaged_safetensors_raise_naming_the_file(tmp_path, what):
    booster, model, optim = _setup()
    booster.export_safetensors(model, tmp_path, max_shard_bytes=600)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    victim = shard if what == "shard" else tmp_path / INDEX_NAME
    _truncate(victim)
    with pytest.raises(CheckpointError) as err:
        load_safetensors_folder(tmp_path)
    assert str(victim) in str(err.value), err.value


def _load_truncated(root: str) -> str:
    booster, model, optim = _setup(seed=1)
    with pytest.raises(CheckpointError) as err:
        booster.load_run(root, model, optim)
    return str(err.value)


def _save(root: str) -> None:
    booster, model, optim = _setup()
    booster.save_run(root, model, optim, state=RunState(step=1))


def test_truncated_shard_raises_on_every_rank(tmp_path):
    """Rank 1 reads rank 1's shard; both ranks raise, nobody hangs in DCP's collective read."""
    run_distributed(_save, 2, str(tmp_path), timeout=120)
    victim = next(tmp_path.glob("step-*")) / "dcp" / "__1_0.distcp"
    _truncate(victim)
    messages = run_distributed(_load_truncated, 2, str(tmp_path), timeout=120)
    assert len(messages) == 2 and all(m for m in messages), messages
