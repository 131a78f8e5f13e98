"""The resident fast path without copies: on one rank with fp32 chunks all on the device, the fp32
master *is* the working chunk (``[Note: aliased masters]`` in ``chunk_manager.py``) and gradients
stay in ``param.grad`` (``[Note: native gradients]`` in ``ddp.py``).

Reference: plain ``torch.optim.AdamW`` on the same module, fp32. With nothing copied or re-summed
the update is the same arithmetic on the same tensors, so the results are compared bitwise
(``torch.equal``); with clipping, Gemini's norm (``colossal.optim``) and torch's
``clip_grad_norm_`` sum in different orders, so 1e-6 relative. Covered: aliasing holds (shared
storage, no master copy), gradient accumulation over micro-batches, a parameter without a gradient
left untouched, leaving the fast path in the middle of a step (an observer turns the hooks back on:
the gradients in ``param.grad`` move into the chunks), and an evicted chunk (the master gets its own
buffer again, and aliases again once the chunk is back).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from colossal.gemini import GeminiDDP, GeminiOptimizer, events

V, D, STEPS = 32, 16, 6


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(3))
        self.unused = nn.Linear(D, D)  # never gets a gradient: left untouched (no weight decay)
        self.head = nn.Linear(D, V)

    def forward(self, x, skip=False):
        h = self.emb(x)
        for i, block in enumerate(self.blocks):
            if not (skip and i == 1):
                h = h + block(h)
        return self.head(h)


def _batch(step, micro):
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randint(0, V, (2, 5), generator=g), torch.randint(0, V, (2, 5), generator=g)


def _loss(model, step, micro):
    x, y = _batch(step, micro)
    return F.cross_entropy(model(x, skip=step == 3).reshape(-1, V), y.reshape(-1))


def _pair(max_grad_norm=None):
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    gem = GeminiDDP(model, chunk_size=600, device_memory_budget=1 << 30)
    opt = GeminiOptimizer(
        torch.optim.AdamW(gem.parameters(), lr=1e-2, weight_decay=0.1), gem, max_grad_norm=max_grad_norm
    )
    return ref, ref_opt, model, gem, opt


def _ref_step(ref, ref_opt, step, micros, max_grad_norm=None):
    for k in range(micros):
        _loss(ref, step, k).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm)
    ref_opt.step()
    ref_opt.zero_grad()


def _check(ref, gem, exact=True):
    """The reference's parameters against GeminiDDP's full state (its fp32 masters; a chunk not on the
    device has no working data to read)."""
    got = gem.state_dict()
    for name, a in ref.named_parameters():
        b = got[name]
        if exact:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("micros", [1, 2])
def test_aliased_native_matches_plain_adamw(micros):
    ref, ref_opt, model, gem, opt = _pair()
    unused = ref.unused.weight.detach().clone()  # (the wrapped module's chunks are not on the device yet)
    for step in range(STEPS):
        for k in range(micros):
            opt.backward(_loss(gem, step, k))
            if step >= 2:  # placed (step 1) and refreshed once: every master is its chunk, grads stay native
                assert gem._native
                assert model.head.weight.grad is not None and model.unused.weight.grad is None
        opt.step()
        _ref_step(ref, ref_opt, step, micros)
        _check(ref, gem)
    m = gem.manager
    for c in m.chunks:
        assert c.master is c.payload  # no fp32 master copy: the optimizer steps the working chunk
        for fake, lo, hi, _ in opt.slices[c.id]:
            assert fake.data_ptr() == c.payload[lo:hi].data_ptr()
        assert c.grad_shard.untyped_storage().nbytes() == 0  # native: autograd's gradients take these bytes
    assert torch.equal(model.unused.weight, unused)
    assert all(p.grad is None for p in model.parameters())  # step() clears them, as zero_grad does


def test_clipping_on_native_gradients():
    ref, ref_opt, model, gem, opt = _pair(max_grad_norm=0.05)
    for step in range(STEPS):
        opt.backward(_loss(gem, step, 0))
        norm = opt.grad_norm()
        opt.step()
        ref_norm = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in _ref_grads(ref, step)]))
        torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
        _ref_step(ref, ref_opt, step, 1, max_grad_norm=0.05)
        assert opt.last_grad_norm is not None and opt.last_grad_norm > 0.05  # it did clip
        _check(ref, gem, exact=False)
    assert gem._native


def _ref_grads(ref, step):
    """The reference's gradients for ``step`` (computed on a copy, so the reference itself is not touched)."""
    twin = copy.deepcopy(ref)
    _loss(twin, step, 0).backward()
    return [p for p in twin.parameters() if p.grad is not None]


def test_leave_fast_path_mid_step_and_evict():
    ref, ref_opt, model, gem, opt = _pair()
    for step in range(STEPS):
        if step == 3:  # micro-batch 0 native, then an observer turns the hooks back on for micro-batch 1
            opt.backward(_loss(gem, step, 0))
            assert gem._native and model.head.weight.grad is not None
            seen = []
            handle = events.register_observer(seen.append)
            try:
                opt.backward(_loss(gem, step, 1))
                assert not gem._native and model.head.weight.grad is None  # moved into the chunks
                opt.step()
            finally:
                handle.remove()
            assert seen
            _ref_step(ref, ref_opt, step, 2)
        elif step == 4:  # evict an aliased chunk: its master gets its own buffer with the same values
            m = gem.manager
            c = m.chunks[0]
            assert c.master is c.payload
            before = c.payload.detach().clone()
            m.evict(c)
            assert c.master is not c.payload and torch.equal(c.master, before)
            for fake, lo, hi, _ in opt.slices[c.id]:
                assert fake.data_ptr() == c.master[lo:hi].data_ptr()
            opt.backward(_loss(gem, step, 0))
            opt.step()
            _ref_step(ref, ref_opt, step, 1)
            assert c.master is c.payload  # fetched back and refreshed: aliased again
        else:
            opt.backward(_loss(gem, step, 0))
            opt.step()
            _ref_step(ref, ref_opt, step, 1)
        _check(ref, gem)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_native_overflow_skips_the_step(bad):
    ref, ref_opt, model, gem, opt = _pair()
    for step in range(STEPS):
        opt.backward(_loss(gem, step, 0))
        if step == 3:
            assert gem._native
            before = {k: v.clone() for k, v in gem.state_dict().items()}
            model.blocks[0][0].weight.grad[1, 2] = bad  # a non-finite gradient, as an overflow leaves it
            assert opt.step() is False and opt.skipped_steps == 1
            assert all(torch.equal(v, before[k]) for k, v in gem.state_dict().items())  # nothing stepped
            assert all(p.grad is None for p in model.parameters())  # and the gradients are dropped
            continue  # the reference skips the step too
        assert opt.step() is True
        _ref_step(ref, ref_opt, step, 1)
        _check(ref, gem)
