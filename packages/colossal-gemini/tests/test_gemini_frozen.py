"""Frozen parameters (a LoRA-style model: frozen base, small trainable adapters) under Gemini.

A frozen chunk holds only working data ([Note: frozen chunks] in ``colossal.gemini.chunk``): no
gradient, no master, no optimizer state. Reference: plain PyTorch AdamW over the same model (its
frozen parameters get no gradient, so torch leaves them alone), fp32. Losses and trainable weights
agree to 1e-5 relative (summation order of the sharded reductions); frozen weights are bitwise
unchanged. Covers one and two ranks (sharded), static and auto placement under budget pressure, the
disk tier, bf16 (frozen bytes: 2 per parameter, no fp32 copy), state-dict round trips through a
frozen chunk, and the optimizer state dict (no entry for a frozen parameter).
"""

import torch
import torch.distributed as dist
from torch import nn

from colossal.comm.testing import run_distributed
from colossal.gemini import GeminiDDP, GeminiOptimizer
from colossal.testkit import GPT, GPTConfig, add_adapters, assert_close, lm_loss, random_batches

STEPS, RANK = 3, 4


def _model(init=None) -> nn.Module:
    torch.manual_seed(0)
    model = add_adapters(GPT(GPTConfig(init="torch")), RANK)
    model.lm_head.requires_grad_(True)  # a trainable module between frozen ones (modules_to_save)
    if init is not None:
        model.load_state_dict(init)
    return model


def _frozen_names(model) -> set[str]:
    return {n for n, p in model.named_parameters() if not p.requires_grad}


def _reference(batches):
    model = _model()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # all parameters, as a user writes it
    losses = []
    for x, y in batches:
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return init, model.state_dict(), losses


def _train(batches, init, kw, rank=0, world=1):
    model = _model(init)
    gem = GeminiDDP(model, chunk_size=8192, **kw)
    opt = GeminiOptimizer(torch.optim.AdamW(gem.parameters(), lr=1e-2), gem)
    losses = []
    for x, y in batches:
        b = x.shape[0] // world
        loss = lm_loss(gem(x[rank * b : (rank + 1) * b]), y[rank * b : (rank + 1) * b])
        opt.backward(loss)
        assert opt.step()
        t = loss.detach().clone()
        if world > 1:
            dist.all_reduce(t)
        losses.append(t.item() / world)
    return gem, opt, losses


def _check(state, ref_state, init, frozen, losses, ref_losses, prefix=""):
    for a, b in zip(losses, ref_losses, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (losses, ref_losses)
    for k, v in ref_state.items():
        if k in frozen:
            assert torch.equal(state[prefix + k], init[k]), f"frozen {k} changed"
        else:
            assert_close(state[prefix + k], v, k)


def _rank_train(batches, init, kw, path):
    rank, world = dist.get_rank(), dist.get_world_size()
    gem, opt, losses = _train(batches, init, kw, rank, world)
    opt.save_sharded(path)  # frozen slices come from the working shards
    chunks = gem.manager.chunks
    kinds = [(c.frozen, c.master is None, c.grad_shard is None) for c in chunks]
    return gem.state_dict(), losses, kinds, list(opt.state_dict()["state"]), gem.stats.bytes_moved


def test_frozen_chunks_match_pytorch_on_one_rank_static_and_auto_under_pressure(tmp_path):
    batches = random_batches(STEPS, batch=2, seq=8)
    init, ref_state, ref_losses = _reference(batches)
    frozen = _frozen_names(_model())
    for kw in (
        dict(placement="static", offload_param_frac=0.5, device_memory_budget=1 << 20),
        dict(placement="auto", device_memory_budget=300_000),
        dict(placement="auto", device_memory_budget=300_000, disk_dir=str(tmp_path), host_memory_budget=700_000),
    ):
        gem, opt, losses = _train(batches, init, kw)
        m = gem.manager
        assert any(c.frozen for c in m.chunks) and any(not c.frozen for c in m.chunks)
        assert gem.stats.bytes_moved > 0 and ("disk_dir" not in kw or gem.stats.disk_bytes_read > 0)
        for c in m.chunks:  # never mixed; a frozen chunk has no master, gradient or state
            assert all(info.param.requires_grad != c.frozen for info in c.tensors)
            assert (c.master is None and c.grad_shard is None) == c.frozen
        names = [n for n, _ in _model().named_parameters()]
        assert not {names[i] for i in opt.state_dict()["state"]} & frozen  # no state for a frozen parameter
        _check(gem.state_dict(), ref_state, init, frozen, losses, ref_losses)


def test_frozen_chunks_sharded_over_two_ranks_match_pytorch_and_reload_on_one(tmp_path):
    batches = random_batches(STEPS, batch=2, seq=8)
    init, ref_state, ref_losses = _reference(batches)
    frozen = _frozen_names(_model())
    kw = dict(placement="auto", device_memory_budget=300_000)
    path = str(tmp_path / "ckpt")
    results = run_distributed(_rank_train, 2, batches, init, kw, path, timeout=120)
    gem = GeminiDDP(_model(), chunk_size=8192, placement="static", device_memory_budget=1 << 20)
    opt = GeminiOptimizer(torch.optim.AdamW(gem.parameters(), lr=1e-2), gem)
    opt.load_sharded(path)  # two ranks' shards into one rank's chunks, frozen ones included
    _check(gem.state_dict(), ref_state, init, frozen, [], [])
    for state, losses, kinds, opt_keys, moved in results:
        assert moved > 0  # chunks were evicted and fetched again
        assert all(frozen_ == no_master == no_grad for frozen_, no_master, no_grad in kinds)
        _check(state, ref_state, init, frozen, losses, ref_losses)
        # torch's indices over the original groups: no state for a frozen parameter
        names = [n for n, _ in _model().named_parameters()]
        assert not {names[i] for i in opt_keys} & frozen


def test_frozen_base_in_bf16_takes_two_bytes_per_parameter_and_loads_through_state_dict():
    model = _model()
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    gem = GeminiDDP(
        model,
        chunk_size=8192,
        placement="static",
        offload_param_frac=1.0,
        mixed_precision=torch.bfloat16,
        device_memory_budget=1 << 20,
    )
    m = gem.manager
    shard = sum(c.shard_nbytes for c in m.chunks if c.frozen)
    assert frozen * 2 <= shard < frozen * 2 + 8192 * 2 * sum(c.frozen for c in m.chunks)  # padding at most
    # host holds each frozen chunk once: working shard only (trainable: shard + fp32 master + grad)
    train_bytes = sum(c.shard_nbytes + 8 * c.shard_size for c in m.trainable)
    assert m.host.used_bytes == shard + train_bytes
    # a state-dict round trip writes frozen values into their working shards
    params = dict(model.named_parameters(remove_duplicate=False))
    fresh = {p: torch.randn(p.shape) for p in params.values()}  # one value per parameter (wte is lm_head)
    new = {k: fresh[p] for k, p in params.items()}
    gem.load_state_dict(new, strict=False)
    back = gem.state_dict()
    for k, v in new.items():  # frozen: stored in bf16 only; trainable: its fp32 master
        assert torch.equal(back[k], v.to(torch.bfloat16).float() if not params[k].requires_grad else v), k


def test_frozen_base_larger_than_the_device_and_host_budgets_trains_within_both(tmp_path):
    """The memory claim of fine-tuning: a bf16 frozen base of 1.56 MiB trains its adapters within a
    0.75 MiB device budget and a 1.25 MiB host budget, the base streaming from the disk tier every
    step (peaks as Gemini accounts them; the budgets are what the placement must respect)."""
    torch.manual_seed(0)
    config = GPTConfig(init="torch", n_layer=16, n_embd=64, n_head=4, vocab_size=256, block_size=64)
    model = add_adapters(GPT(config), RANK)
    frozen = sum(2 * p.numel() for p in model.parameters() if not p.requires_grad)  # bf16 working data
    device, host = 3 << 18, 5 << 18  # 0.75 MiB, 1.25 MiB
    assert frozen > host > device
    before = {n: p.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters() if not p.requires_grad}
    gem = GeminiDDP(model, placement="auto", device_memory_budget=device, mixed_precision=torch.bfloat16,
                    disk_dir=str(tmp_path), host_memory_budget=host, chunk_size=1 << 14)  # fmt: skip
    opt = GeminiOptimizer(torch.optim.AdamW([p for p in gem.parameters() if p.requires_grad], lr=1e-2), gem)
    for x, y in random_batches(STEPS, batch=1, seq=16, vocab=256):
        opt.backward(lm_loss(gem(x), y))
        opt.step()
        stats = gem.stats
        assert stats.peak_device_bytes <= device and stats.host_peak_bytes <= host
        assert stats.disk_bytes_read >= frozen - host  # what the host cannot hold came from disk
    state = gem.state_dict()
    assert all(torch.equal(state[n].to(torch.bfloat16), v) for n, v in before.items())  # the base: unchanged
    trained = [n for n in state if ".lora_b." in n]
    assert trained and all(state[n].abs().sum() > 0 for n in trained)  # the adapters trained (lora_b starts at 0)
