"""launch(): environment detection for torchrun / SLURM / OpenMPI / a plain process."""

import os
import socket
import subprocess
import sys

import pytest

from colossal.comm import detect_launcher


def test_plain_process_is_world_of_one():
    info = detect_launcher({})
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("none", 0, 1, 0)


def test_torchrun_variables():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h0", "MASTER_PORT": "1234"}
    info = detect_launcher(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.master_addr, info.master_port) == (
        "torchrun",
        3,
        8,
        1,
        "h0",
        1234,
    )


def test_slurm_variables_and_nodelist():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[03-05,9],cpu1"}
    info = detect_launcher(env)
    assert (info.launcher, info.rank, info.world_size, info.master_addr) == ("slurm", 5, 8, "gpu03")


def test_openmpi_variables():
    env = {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
    }
    info = detect_launcher(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("openmpi", 1, 2, 1)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RANK": "0"}, r"torchrun environment is half set: have \['RANK'\], missing \['WORLD_SIZE'\]"),
        ({"RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "x"}, r"RANK=4 must lie in \[0, WORLD_SIZE=4\)"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "needs MASTER_ADDR"),
        ({"SLURM_NTASKS": "2"}, "slurm environment is half set"),
    ],
)
def test_half_set_environments_are_named(env, message):
    with pytest.raises(ValueError, match=message):
        detect_launcher(env)


_SCRIPT = """
import torch, colossal.comm as cc
info = cc.launch(backend="gloo")
t = torch.tensor([info.rank + 1.0]); cc.all_reduce(t)
print(info.launcher, info.rank, info.world_size, int(t.item()))
"""


def _run(env_extra: dict) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.Popen([sys.executable, "-c", _SCRIPT], env=env | env_extra, stdout=subprocess.PIPE, text=True)


def test_launch_plain_process_and_two_torchrun_style_processes():
    plain = _run({})
    assert plain.communicate(timeout=60)[0].split() == ["none", "0", "1", "1"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [_run(common | {"RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    try:
        outs = [p.communicate(timeout=60)[0].split() for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert outs == [["torchrun", "0", "2", "3"], ["torchrun", "1", "2", "3"]]


def test_launch_rejects_bad_backend():
    from colossal.comm import launch

    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl', got 'mpi'"):
        launch(backend="mpi", env={})
