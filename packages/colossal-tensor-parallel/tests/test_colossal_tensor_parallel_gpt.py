"""Whole-model parity: a GPT block and a few SGD steps of the small GPT, converted in place by
each mode's ``apply_*`` with the ready ``gpt_plan``, match dense training."""

import copy

import pytest
import torch
import torch.distributed as dist
from tp_testing import param_bytes

from colossal.comm import Mesh, all_reduce
from colossal.comm.testing import run_distributed
from colossal.tensor_parallel import (
    DropoutMode,
    Grid2D,
    ParallelDropout,
    RNGTracker,
    apply_1d,
    apply_2d,
    cross_entropy_1d,
    cross_entropy_2d,
    gpt_plan,
    parallelize,
)
from colossal.tensor_parallel.sequence import all_reduce_gradients, apply_sequence, split_sequence
from colossal.testkit import GPT, GPTConfig, assert_close, randomize_biases_

CFG = dict(vocab_size=32, block_size=8, n_embd=16, n_layer=2, n_head=4)
STEPS, LR = 3, 0.5


def _dense_losses(model, batches):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for idx, tgt in batches:
        loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), tgt.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _parallel_losses(model, batches, loss_fn):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for idx, tgt in batches:
        loss = loss_fn(model(idx), tgt)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _setup(batch, **overrides):
    torch.manual_seed(0)
    dense = randomize_biases_(GPT(GPTConfig(**{**CFG, **overrides})))  # a dropped bias must show
    idx = torch.randint(0, CFG["vocab_size"], (batch, 8))
    batches = [(idx, torch.roll(idx, -1, dims=1))] * STEPS  # same batch: the loss must fall
    return dense, copy.deepcopy(dense), batches


def _replicated_1d_bytes(model):
    """1D keeps position embeddings, LayerNorms and row-parallel biases whole (docs "1D")."""
    keep = ("wpe.", "ln_", "out_proj.bias", "fc_out.bias")
    return sum(p.numel() * 4 for n, p in model.named_parameters() if any(k in n for k in keep))


def _check_training(mode, apply, loss_fn, batch=2, divisor=None, dropout=0.0, seed=7):
    """Train dense and parallel copies side by side; per-rank parameter bytes must be dense/divisor
    (1D: the replicated parameters whole, the rest / P)."""
    dense, model, batches = _setup(batch, dropout=dropout)
    apply(model)
    assert model.lm_head.weight is model.wte.weight, "tied embeddings must stay tied"
    if divisor is not None:
        rep = _replicated_1d_bytes(dense) if mode == "1d" else 0
        assert param_bytes(model) == (param_bytes(dense) - rep) // divisor + rep, (mode, param_bytes(model))
    got = _parallel_losses(model, batches, loss_fn)
    torch.manual_seed(seed)  # dense dropout draws from the same stream as the tracker's replicated one
    want = _dense_losses(dense, batches)
    for step, (a, b) in enumerate(zip(got, want)):
        assert_close(a, b, f"{mode} loss at step {step}")
    assert got[-1] < got[0], "training must reduce the loss"


def _gpt_1d():
    group = Mesh(axes={"tp": -1}).group("tp")
    p = dist.get_world_size(group)
    _check_training(
        "1d", lambda m: apply_1d(m, group, gpt_plan("1d")), lambda lg, t: cross_entropy_1d(lg, t, group), divisor=p
    )
    # with dropout: 1D activations are replicated, so the tracker's shared stream reproduces the
    # dense model's masks exactly (same seed, same calls in the same order)
    _check_training(
        "1d",
        lambda m: parallelize(m, "1d", group, rng=RNGTracker(7, dist.get_rank(group))),
        lambda lg, t: cross_entropy_1d(lg, t, group),
        dropout=0.2,
    )


def test_gpt_1d_training_matches_dense():
    run_distributed(_gpt_1d, 2, timeout=120)


def _gpt_sequence(dp, kind):
    mesh = Mesh(axes={"dp": dp, "sp": -1})
    sp, both = mesh.group("sp"), mesh.product_group("dp", "sp")
    dense, model, batches = _setup(2)
    apply_sequence(model, sp, gpt_plan("sequence"), kind=kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    got = []
    for idx, tgt in batches:
        mine = [split_sequence(x.chunk(dp)[mesh.coordinate("dp")], sp) for x in (idx, tgt)]
        loss = torch.nn.functional.cross_entropy(model(mine[0]).flatten(0, 1), mine[1].flatten())
        opt.zero_grad()
        loss.backward()
        all_reduce_gradients(model, both)  # mean over data and sequence shards
        opt.step()
        got.append(all_reduce(loss.detach(), group=both) / dist.get_world_size(both))
    for step, (a, b) in enumerate(zip(got, _dense_losses(dense, batches))):
        assert_close(a, b, f"sequence {kind} dp={dp} loss at step {step}")


@pytest.mark.parametrize(("world", "dp", "kind"), [(2, 1, "all_to_all"), (4, 2, "ring")])
def test_gpt_sequence_parallel_with_data_parallel(world, dp, kind):
    run_distributed(_gpt_sequence, world, dp, kind, timeout=120)


def _gpt_2d():
    mesh = Mesh(axes={"tp": 4})
    grid = Grid2D.of(mesh.layout("2d", "tp"))
    _check_training(
        "2d", lambda m: apply_2d(m, mesh, gpt_plan("2d")), lambda lg, t: cross_entropy_2d(lg, t, grid), divisor=4
    )
    # dropouts of a split mode draw per-rank masks
    model = parallelize(GPT(GPTConfig(**CFG, dropout=0.1)), "2d", mesh, rng=RNGTracker(7, dist.get_rank()))
    drops = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert drops and all(isinstance(m, ParallelDropout) and m.mode == DropoutMode.SPLIT for m in drops)


def test_gpt_2d_training_matches_dense():
    run_distributed(_gpt_2d, 4, timeout=120)
