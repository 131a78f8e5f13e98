"""Expert parallelism applied to a MoE GPT (``colossalai.booster.hybrid.ep``): ep=2 x edp=2 on 4
ranks with DDP for the dense parameters trains exactly like one process; its dense checkpoint
loads with ep=1 (plain model) and ep=4 and gives the same next loss."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from colossal.comm.testing import run_distributed
from colossalai.booster.hybrid.ep import apply_expert_parallel
from colossalai.models import build_gpt, build_moe_gpt

KW = dict(num_experts=4, top_k=2, block_size=16, capacity_factor=1.0)


def _rel(a, b):
    """Norm-relative error; the floor 1e-2 keeps parameters that barely move (k_proj.bias: softmax
    ignores a bias shared by every key, so its gradient is rounding noise) from dividing by ~0."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-2)).item()


def _loss(model, idx):
    return F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()) + model.aux_loss()


def _train_and_reload():
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(7)
    idx = [torch.randint(0, 256, (2, 16), generator=gen) for _ in range(world)]
    full = build_moe_gpt("moe-tiny", seed=0, **KW)  # the single-process reference, every expert
    model = build_moe_gpt("moe-tiny", seed=0, **KW)
    ep = apply_expert_parallel(model, 2)
    ddp = DDP(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(full.parameters(), lr=0.5)
    for _ in range(2):
        opt.zero_grad(), ref_opt.zero_grad()
        F.cross_entropy(ddp(idx[rank]).flatten(0, 1), idx[rank].flatten()).add(model.aux_loss()).backward()
        ep.reduce_expert_gradients(model)
        opt.step()
        (sum(_loss(full, i) for i in idx) / world).backward()
        ref_opt.step()
    state = ep.full_state_dict(model)
    assert list(state) == list(full.state_dict())
    for name, t in full.state_dict().items():
        assert _rel(state[name], t) < 1e-5, name
    want = _loss(full, idx[rank]).item()
    plain = build_moe_gpt("moe-tiny", seed=3, **KW)  # ep=1: the checkpoint loads into a plain model
    plain.load_state_dict(state, strict=True)
    assert abs(_loss(plain, idx[rank]).item() - want) < 1e-5 * abs(want)
    wide = build_moe_gpt("moe-tiny", seed=3, **KW)  # ep=4
    ep4 = apply_expert_parallel(wide, 4)
    ep4.load_full_state_dict(wide, state)
    assert abs(_loss(wide, idx[rank]).item() - want) < 1e-5 * abs(want)
    assert wide.blocks[1].mlp.experts.w_in.shape[0] == 1 and model.blocks[1].mlp.experts.w_in.shape[0] == 2


def test_ep2_edp2_trains_like_one_process_and_reloads_at_ep1_and_ep4():
    run_distributed(_train_and_reload, 4, timeout=180)


def _errors():
    with pytest.raises(ValueError, match="ep_size=3 must be a positive int dividing the data-parallel size 4"):
        apply_expert_parallel(build_moe_gpt("moe-tiny", seed=0), 3)
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by ep_size=4"):
        apply_expert_parallel(build_moe_gpt("moe-tiny", num_experts=6, seed=0), 4)
    with pytest.raises(ValueError, match="has no colossal.moe.MoE layer"):
        apply_expert_parallel(build_gpt("tiny", seed=0), 2)


def test_errors_before_any_collective():
    run_distributed(_errors, 4, timeout=60)
