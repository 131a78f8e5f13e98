"""Bad input gives clear errors on every rank before any collective; memory samples and
per-step communication totals are observable from the wrapper."""

import pytest
import torch
import torch.distributed as dist
from colossal_zero_testutil import loss_of, make_model, make_optimizer, rank_batch
from torch import nn

from colossal.comm.testing import run_distributed
from colossal.zero import MemorySample, ZeroConfig, ZeroOptimizer, register_observer, shard_model


def _error(fn):
    try:
        fn()
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as exc:
        return type(exc).__name__, str(exc)
    return None


def bad_inputs():
    model = make_model()
    stranger = nn.Parameter(torch.zeros(3))
    only_rank0 = dist.new_group([0])  # every rank must create it; rank 1 is not a member
    stepped = make_optimizer(make_model())
    m2 = make_model()
    for p in m2.parameters():
        p.grad = torch.zeros_like(p)
    stepped = torch.optim.AdamW(m2.parameters())
    stepped.step()
    meta = make_model().to("meta")
    cases = {
        "not_optimizer": lambda: ZeroOptimizer(object(), model),
        "stranger_param": lambda: ZeroOptimizer(torch.optim.SGD([stranger], lr=1), model),
        "stepped": lambda: ZeroOptimizer(stepped, m2),
        "meta": lambda: ZeroOptimizer(torch.optim.SGD(meta.parameters(), lr=1), meta),
        "bad_stage": lambda: ZeroOptimizer(make_optimizer(model), model, stage=4),
        "bad_dtype": lambda: ZeroConfig(param_dtype=torch.int32),
        "overlap": lambda: ZeroOptimizer(make_optimizer(model), model, replicate_group=dist.group.WORLD),
        "both_config": lambda: ZeroOptimizer(make_optimizer(model), model, config=ZeroConfig(), stage=2),
        "shard_model_stage": lambda: shard_model(model, make_optimizer(model), stage=2),
    }
    out = {k: _error(f) for k, f in cases.items()}
    if dist.get_rank() == 1:
        out["not_member"] = _error(lambda: ZeroOptimizer(make_optimizer(model), model, group=only_rank0))
    zero = shard_model(model, make_optimizer(model))
    assert zero.config.stage == 3
    out["twice"] = _error(lambda: ZeroOptimizer(make_optimizer(model), model))
    out["closure"] = _error(lambda: zero.step(closure=lambda: 0))
    return out


def test_bad_input_errors():
    for rank, out in enumerate(run_distributed(bad_inputs, 2, timeout=120)):
        expect = {
            "not_optimizer": ("TypeError", "torch.optim.Optimizer"),
            "stranger_param": ("ValueError", "not a parameter of model"),
            "stepped": ("ValueError", "already has state"),
            "meta": ("ValueError", "meta"),
            "bad_stage": ("ValueError", "stage must be 1, 2 or 3"),
            "bad_dtype": ("ValueError", "param_dtype"),
            "overlap": ("ValueError", "meet in exactly this rank"),
            "both_config": ("TypeError", "either config="),
            "shard_model_stage": ("ValueError", "shard_model is stage 3"),
            "twice": ("ValueError", "already managed"),
            "closure": ("NotImplementedError", "closure=None"),
        }
        if rank == 1:
            expect["not_member"] = ("ValueError", "not a member")
        for key, (kind, text) in expect.items():
            assert out[key] is not None, key
            assert out[key][0] == kind and text in out[key][1], (key, out[key])


def observed_step(stage):
    samples = []
    handle = register_observer(samples.append)
    model = make_model()
    zero = ZeroOptimizer(make_optimizer(model), model, stage=stage)
    x, y = rank_batch(0, 0, 1, dist.get_world_size(), dist.get_rank())
    zero.backward(loss_of(model, x, y))
    zero.step()
    handle.remove()
    return samples, zero.memory_stats(), zero.last_step_comm


@pytest.mark.parametrize("stage", [3])
def test_memory_samples_and_comm_stats(stage):
    for samples, stats, comm in run_distributed(observed_step, 2, stage, timeout=120):
        assert [s.kind for s in samples] == ["memory_sample"]
        assert isinstance(samples[0], MemorySample) and samples[0].tier == "cpu"
        assert samples[0].model_bytes > stats["total"] > 0  # sampled before the gradient shards are dropped
        assert stats["total"] == stats["params"] + stats["grads"] + stats["optimizer_states"]
        assert set(comm) == {"all_gather", "reduce_scatter", "all_reduce"}  # all_reduce: the overflow flag


@pytest.mark.parametrize("rule", ["Adafactor", "LBFGS", "SparseAdam"])
def test_a_rule_that_needs_whole_parameters_is_refused(rule):
    """Issue 31 item 5: ZeRO gives the optimizer flat slices; a shape-dependent rule is refused, naming
    what is supported, before any communication (no process group needed to see the error)."""
    model = nn.Linear(4, 3)
    opt = getattr(torch.optim, rule)(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=rf"ZeroOptimizer cannot run torch.optim.{rule}.*Supported: element-wise"):
        ZeroOptimizer(opt, model)
