"""Locating the block sequence, partitioning it, measuring block costs, and the split backward."""

import copy

import pytest
import torch
from pp_testing import TinyGPT, batch, lm_loss, rel_err
from torch import nn

from colossal.pipeline import (
    PipelineConfig,
    WeightGradStore,
    find_blocks,
    materialize_owned,
    measure_block_costs,
    partition_blocks,
    stage_tensor_names,
)


def test_find_blocks_by_name_and_candidates():
    m = TinyGPT()
    assert find_blocks(m) == ("blocks", m.blocks)
    seq = nn.Sequential(nn.Linear(2, 2))
    holder = nn.Module()
    holder.transformer = nn.Module()
    holder.transformer.h = seq
    assert find_blocks(holder) == ("transformer.h", seq)
    with pytest.raises(ValueError, match="has no block sequence: looked for"):
        find_blocks(nn.Linear(2, 2))


def test_partition_methods():
    assert partition_blocks(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="8 blocks are not divisible by pp \\* v = 3"):
        partition_blocks(8, 3)
    with pytest.raises(ValueError, match="cannot fill 9 chunks"):
        partition_blocks(8, 9)
    assert partition_blocks(5, 2, "sizes", sizes=[4, 1]) == [(0, 4), (4, 5)]
    # one heavy block gets a chunk of its own; the embedding weight pushes blocks off chunk 0
    assert partition_blocks(4, 2, "cost", weights=[1, 1, 1, 5]) == [(0, 3), (3, 4)]
    assert partition_blocks(4, 2, "params", weights=[1, 1, 1, 1], first=3) == [(0, 1), (1, 4)]


def test_balanced_partition_is_optimal():
    import itertools

    w = [3, 1, 4, 1, 5, 9, 2, 6]
    got = partition_blocks(8, 3, "cost", weights=w)
    best = min(
        max(sum(w[a:b]) for a, b in zip((0, i, j), (i, j, 8))) for i, j in itertools.combinations(range(1, 8), 2)
    )
    assert max(sum(w[a:b]) for a, b in got) == best


def test_measure_block_costs():
    torch.manual_seed(0)
    m = TinyGPT(n_blocks=3)
    costs = measure_block_costs(m, batch(0)[0])
    assert len(costs) == 3 and all(c.time_s > 0 for c in costs)
    assert costs[0].params == sum(p.numel() for p in m.blocks[0].parameters())
    assert costs[0].activation_bytes == costs[1].activation_bytes > 0  # equal blocks save equal bytes


def test_split_backward_equals_backward():
    torch.manual_seed(0)
    ref = TinyGPT(tied=True)
    model = copy.deepcopy(ref)
    store = WeightGradStore()
    assert store.patch(model) == 4 * len(model.blocks) + 1
    idx, tgt = batch(0)
    lm_loss(ref(idx), tgt).backward()
    with store.capture("mb0"):
        lm_loss(model(idx), tgt).backward()
    assert model.blocks[0].fc.weight.grad is None and model.blocks[0].ln_1.weight.grad is not None
    store.flush("mb0")
    assert store.pending == 0
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert rel_err(a.grad, b.grad) <= 1e-6, n


def test_deferred_weight_gradients_reach_post_accumulate_hooks_and_buffer_views():
    """[Note: deferred gradients through autograd]: an engine that reduces in post-accumulate-grad
    hooks (ZeRO) sees the flushed weight gradients, accumulated in place into its ``.grad`` views;
    a frozen weight is neither computed nor given a gradient."""
    torch.manual_seed(0)
    ref = TinyGPT(tied=True)
    model = copy.deepcopy(ref)
    model.blocks[1].fc.weight.requires_grad_(False)
    ref.blocks[1].fc.weight.requires_grad_(False)
    store = WeightGradStore()
    store.patch(model)
    seen = []
    fc = model.blocks[0].fc.weight
    fc.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    fc.grad = torch.zeros_like(fc)  # an engine's view of its flat buffer: added to in place
    slot = fc.grad.data_ptr()
    idx, tgt = batch(0)
    lm_loss(ref(idx), tgt).backward()
    with store.capture("mb0"):
        lm_loss(model(idx), tgt).backward()
    before = len(seen)  # (autograd may run the hook with nothing added in the input-gradient pass)
    assert not fc.grad.any()  # deferred: nothing accumulated yet
    store.flush("mb0")
    assert len(seen) == before + 1 and rel_err(seen[-1], ref.blocks[0].fc.weight.grad) <= 1e-6
    assert fc.grad.data_ptr() == slot and model.blocks[1].fc.weight.grad is None


@pytest.mark.parametrize("p,v", [(2, 1), (4, 1), (2, 2)])
def test_meta_model_gets_the_dense_values_of_its_own_stages_only(p, v):
    """[Note: same initial values as a dense build]: each rank's tensors equal the dense
    ``to_empty`` + ``reset_parameters`` build from the same seed; the rest stay meta."""
    with torch.device("meta"):
        dense = TinyGPT(tied=True)
    dense.to_empty(device="cpu")
    dense.lm_head.weight = dense.wte.weight  # to_empty unties meta parameters
    torch.manual_seed(7)
    for mod in dense.modules():
        if hasattr(mod, "reset_parameters"):
            mod.reset_parameters()
    ref = dense.state_dict()
    cfg = PipelineConfig(num_microbatches=p, schedule="interleaved" if v > 1 else "1f1b", virtual=v)
    covered = set()
    for rank in range(p):
        with torch.device("meta"):
            model = TinyGPT(tied=True)
        owned = stage_tensor_names(model, cfg, p, rank)
        torch.manual_seed(7)
        materialize_owned(model, owned, torch.device("cpu"), None)
        state = model.state_dict(keep_vars=True)
        assert all(not state[n].is_meta for n in owned)
        for name, t in state.items():  # real: owned, or the tied alias of an owned tensor
            assert t.is_meta or name in owned or t is model.wte.weight, name
            assert t.is_meta or torch.equal(t, ref[name]), name
        assert model.lm_head.weight is model.wte.weight  # ties kept
        covered |= owned
    assert covered == set(ref)


def test_eager_model_is_not_reinitialised_and_draws_nothing():
    """A model built normally keeps its values; splitting it draws no random numbers."""
    model = TinyGPT(tied=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    owned = stage_tensor_names(model, PipelineConfig(num_microbatches=2), 2, 1)
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    materialize_owned(model, owned, torch.device("cpu"), None)
    assert torch.equal(torch.rand(4), expected)
    for name, t in model.state_dict().items():
        assert t.is_meta or torch.equal(t, before[name]), name
