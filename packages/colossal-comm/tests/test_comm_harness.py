"""The multi-process harness: results, fast failure, hang kill with stacks, decorator."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import colossal.comm as cc
from colossal.comm.testing import RankFailure, RankTimeout, distributed_test, run_distributed


def rank_and_size(offset: int, scale: int = 1) -> tuple[int, int]:
    return dist.get_rank() * scale + offset, dist.get_world_size()


def test_return_values_come_back_by_rank():
    assert run_distributed(rank_and_size, 4, 10, scale=2) == [(10, 4), (12, 4), (14, 4), (16, 4)]


def one_rank_raises():
    if dist.get_rank() == 2:
        raise ValueError("bad value 7 on rank 2")
    dist.barrier()  # the others block here, waiting for rank 2


def test_a_raising_rank_fails_the_run_in_seconds_with_its_exception():
    start = time.monotonic()
    with pytest.raises(ValueError, match="bad value 7 on rank 2") as info:
        run_distributed(one_rank_raises, 4, timeout=60)
    # the hung rank sleeps for an hour: the run ends at the 3 s deadline plus start-up and the stack
    # dump, which take seconds more on a loaded machine ([Note: the deadline] in colossal.comm.testing)
    assert time.monotonic() - start < 60
    assert "traceback of rank 2" in str(info.value.__cause__)


def one_rank_hangs():
    if dist.get_rank() == 1:
        time.sleep(3600)
    dist.barrier()


def test_a_hanging_rank_is_killed_at_the_timeout_with_stacks():
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_distributed(one_rank_hangs, 2, timeout=3)
    # the hung rank sleeps for an hour: the run ends at the 3 s deadline plus start-up and the stack
    # dump, which take seconds more on a loaded machine ([Note: the deadline] in colossal.comm.testing)
    assert time.monotonic() - start < 60
    text = str(info.value)
    assert "stacks of rank 0" in text and "stacks of rank 1" in text
    assert "one_rank_hangs" in text  # the hung frame is visible


def one_rank_dies():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def test_a_dying_rank_is_reported():
    with pytest.raises(RankFailure, match="rank 1 died with exit code 3"):
        run_distributed(one_rank_dies, 2, timeout=30)


def test_bad_harness_arguments():
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        run_distributed(rank_and_size, 0)
    with pytest.raises(ValueError, match="backend must be"):
        run_distributed(rank_and_size, 2, backend="mpi")


@distributed_test(world_size=2)
def test_decorated_body_runs_on_every_rank():
    t = torch.tensor([dist.get_rank() + 1.0])
    cc.all_reduce(t)
    assert t.item() == 3.0 and dist.get_world_size() == 2


@pytest.mark.parametrize("value", [3, 5])
@distributed_test(world_size=2)
def test_decorator_forwards_parameters(value):
    t = torch.tensor([float(value)])
    cc.all_reduce(t)
    assert t.item() == 2 * value


def test_preload_after_the_forkserver_started_is_refused():
    from colossal.comm.testing import preload

    run_distributed(rank_and_size, 1, 0)
    preload("torch")  # already preloaded: fine
    with pytest.raises(RuntimeError, match=r"preload \['json'\] before the first run"):
        preload("json")
