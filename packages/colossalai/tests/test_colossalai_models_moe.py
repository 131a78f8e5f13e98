"""The MoE GPT: presets and parameter counts, parity with the dense GPT, aux losses, checkpointing,
and expert parallelism against one process."""

import pytest
import torch
import torch.nn.functional as F

from colossal.comm.testing import run_distributed
from colossal.moe import MoE, expert_groups, reduce_gradients
from colossalai.models import MOE_PRESETS, GPTConfig, build_gpt, build_moe_gpt, moe_gpt_config


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("preset", sorted(MOE_PRESETS))
def test_presets_build_lazily_with_exact_parameter_count(preset):
    model = build_moe_gpt(preset, lazy=True)
    assert all(p.is_meta for p in model.parameters())
    cfg = moe_gpt_config(preset)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()
    assert [cfg.is_moe_block(i) for i in range(cfg.n_layer)] == [i % 2 == 1 for i in range(cfg.n_layer)]
    assert cfg.num_active_parameters() < cfg.num_parameters()


def test_one_expert_equals_the_dense_gpt():
    """With one expert, dropless, every block sparse, the router's softmax is 1: the MoE GPT is
    the dense GPT with its MLP weights stacked, in outputs and in every gradient."""
    gpt = build_gpt(GPTConfig(n_embd=32, n_layer=2, n_head=4, block_size=16), seed=0)
    moe = build_moe_gpt("moe-tiny", num_experts=1, moe_every=1, capacity_factor=None, block_size=16, seed=1)
    state = {k: v for k, v in gpt.state_dict().items() if ".mlp." not in k}
    for i, block in enumerate(gpt.blocks):
        state[f"blocks.{i}.mlp.experts.w_in"] = block.mlp.fc_in.weight.t()[None]
        state[f"blocks.{i}.mlp.experts.b_in"] = block.mlp.fc_in.bias[None]
        state[f"blocks.{i}.mlp.experts.w_out"] = block.mlp.fc_out.weight.t()[None]
        state[f"blocks.{i}.mlp.experts.b_out"] = block.mlp.fc_out.bias[None]
        state[f"blocks.{i}.mlp.router.gate.weight"] = moe.blocks[i].mlp.router.gate.weight
    moe.load_state_dict(state, strict=True)
    idx, tgt = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    for model in (gpt, moe):
        F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten()).backward()
    assert _rel(moe(idx), gpt(idx)) < 1e-6
    grads = dict(moe.named_parameters())
    for name, p in gpt.named_parameters():
        if ".mlp." not in name:
            assert _rel(grads[name].grad, p.grad) < 1e-5, name
    for i, block in enumerate(gpt.blocks):
        assert _rel(moe.blocks[i].mlp.experts.w_in.grad[0], block.mlp.fc_in.weight.grad.t()) < 1e-5
        assert _rel(moe.blocks[i].mlp.experts.w_out.grad[0], block.mlp.fc_out.weight.grad.t()) < 1e-5


def test_aux_loss_exposed_and_checkpointing_keeps_it():
    model = build_moe_gpt("moe-tiny", n_layer=4, top_k=2, seed=0)
    assert model.aux_loss().item() == 0.0
    idx = torch.randint(0, 256, (2, 32))
    model(idx)
    stats = model.moe_stats()
    assert len(stats) == 2 and all(s.tokens == 64 for s in stats)
    expected = sum(0.01 * s.load_balancing_loss + 0.001 * s.z_loss for s in stats)
    assert abs(model.aux_loss().item() - expected) < 1e-6
    model.aux_loss().backward()
    plain = model.blocks[1].mlp.router.gate.weight.grad.clone()
    model.zero_grad()
    model.set_activation_checkpointing(True)
    model(idx)
    model.aux_loss().backward()
    assert _rel(model.blocks[1].mlp.router.gate.weight.grad, plain) < 1e-6


def test_config_errors():
    with pytest.raises(ValueError, match="top_k=5 exceeds num_experts=4"):
        moe_gpt_config("moe-tiny", top_k=5)
    with pytest.raises(ValueError, match="moe_every=3 exceeds n_layer=2"):
        moe_gpt_config("moe-tiny", moe_every=3)


def _ep_parity(ep):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    groups = expert_groups(ep)
    full = build_moe_gpt("moe-tiny", num_experts=4, top_k=2, block_size=16, seed=0)
    sharded = build_moe_gpt("moe-tiny", num_experts=4, top_k=2, block_size=16, seed=0)
    for i, block in enumerate(sharded.blocks):
        if isinstance(block.mlp, MoE):
            block.mlp = MoE.from_dense(full.blocks[i].mlp, groups.ep)
    gen = torch.Generator().manual_seed(5)
    idx = [torch.randint(0, 256, (2, 16), generator=gen) for _ in range(world)]
    for r in range(world):  # reference: every rank's batch through the full model, losses summed
        (F.cross_entropy(full(idx[r]).flatten(0, 1), idx[r].flatten()) + full.aux_loss()).backward()
    loss = F.cross_entropy(sharded(idx[rank]).flatten(0, 1), idx[rank].flatten()) + sharded.aux_loss()
    loss.backward()
    reduce_gradients(sharded, groups)
    ref = dict(full.named_parameters())
    for name, p in sharded.named_parameters():
        want = ref[name].grad / world
        if ".experts." in name:
            want = want[sharded.blocks[1].mlp.local_experts.start : sharded.blocks[1].mlp.local_experts.stop]
        assert _rel(p.grad, want) < 1e-5, name


def test_expert_parallel_moe_gpt_equals_one_process():
    run_distributed(_ep_parity, 2, 2, timeout=120)
