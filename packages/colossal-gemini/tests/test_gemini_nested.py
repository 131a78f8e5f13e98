"""Modules that own parameters *and* call children (``[Note: parent modules]`` in ``ddp.py``).

A parent's pre-backward hook may fire before a child's backward has run (the child's output is the
parent's output), or the parent's own backward ops may run after a child's operator began. Gemini
must keep such chunks on the device until their gradients arrive. Reference: the same module in
plain PyTorch; tolerance fp32 1e-5 relative (same ops, gradients copied through chunk buffers).
"""

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _pop_mode

from colossal.comm.testing import run_distributed
from colossal.gemini import GeminiDDP, GeminiOptimizer
from colossal.gemini.chunk import Chunk, TensorState


class _Net(nn.Module):
    """``scale`` is the root's own parameter; ``tail`` adds an op after the child (param before child)."""

    def __init__(self, tail: bool):
        super().__init__()
        self.tail = tail
        self.scale = nn.Parameter(torch.randn(16))
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 16)

    def forward(self, x):
        y = self.head(self.body(x) * self.scale)  # tail=False: the root's output IS head's output
        return y * 2.0 if self.tail else y


def _train(tail: bool, budget: int, prefetch: int, steps: int = 3):
    torch.manual_seed(0)
    net = _Net(tail)
    ref = _Net(tail)
    ref.load_state_dict(net.state_dict())
    gem = GeminiDDP(net, device_memory_budget=budget, chunk_size=512, prefetch=prefetch)
    opt = GeminiOptimizer(torch.optim.SGD(gem.parameters(), lr=0.1), gem)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for s in range(steps):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(s))
        opt.backward(gem(x).square().mean())
        opt.step()
        ref(x).square().mean().backward()
        ropt.step()
        ropt.zero_grad()
    return gem.state_dict(), ref.state_dict()


def _check(got, ref):
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tail", [False, True], ids=["child-output-is-output", "param-before-child"])
@pytest.mark.parametrize("budget", [10_000_000, 12_000], ids=["roomy", "tight"])
def test_parent_with_params_matches_torch_on_one_rank(tail, budget):
    _check(*_train(tail, budget, prefetch=0))


def _rank(tail, prefetch):
    return _train(tail, 10_000_000, prefetch)


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("tail", [False, True], ids=["child-output-is-output", "param-before-child"])
def test_parent_with_params_matches_torch_on_two_ranks(tail, prefetch):
    for got, ref in run_distributed(_rank, 2, tail, prefetch, timeout=120):
        _check(got, ref)


def test_reading_a_released_chunk_in_backward_raises_instead_of_crashing(monkeypatch):
    # the old rule (only COMPUTE pins a chunk) releases head's chunk before its backward runs: the
    # saved-tensor guard must turn that into a clear error (it used to be a segfault / setStorage error)
    monkeypatch.setattr(Chunk, "in_use", property(lambda c: any(i.state is TensorState.COMPUTE for i in c.tensors)))
    with pytest.raises(RuntimeError, match="not on the device"):
        _train(False, 10_000_000, prefetch=0, steps=1)
    assert torch._C._len_torch_dispatch_stack() == 0  # raised inside backward: the warm-up tracker is popped


def test_a_bare_backward_that_fails_in_warm_up_leaves_nothing_alive(monkeypatch):
    """``loss.backward()`` (not the optimizer's) raising inside backward: the tracker cannot be popped
    there, so it goes inert; it holds no reference to the model (collected once the user drops it)
    and the optimizer's next call pops it."""
    monkeypatch.setattr(Chunk, "in_use", property(lambda c: any(i.state is TensorState.COMPUTE for i in c.tensors)))
    for pop in ("zero_grad", "drop"):
        torch.manual_seed(0)
        gem = GeminiDDP(_Net(False), device_memory_budget=10_000_000, chunk_size=512, prefetch=0)
        opt = GeminiOptimizer(torch.optim.SGD(gem.parameters(), lr=0.1), gem)
        with pytest.raises(RuntimeError, match="not on the device"):
            gem(torch.randn(4, 16)).square().mean().backward()
        assert torch._C._len_torch_dispatch_stack() == 1 and gem.tracker.passthrough  # inert, still pushed
        if pop == "zero_grad":
            opt.zero_grad()
            assert torch._C._len_torch_dispatch_stack() == 0
        else:
            ref = weakref.ref(gem)
            del gem, opt
            gc.collect()
            assert ref() is None  # the pushed mode kept the model (and its chunks) alive
            _pop_mode()  # what a later call of the dropped engine would have done


def test_a_dropped_engine_is_freed():
    """``[Note: weak hooks]`` in ``colossal.comm.hooks``: the gradient hooks Gemini leaves on the
    parameters (kept in C++, out of the cycle collector's sight) used to keep every GeminiDDP, its
    chunks and its model alive after the user's last reference, resident fast path included."""
    refs = []
    for budget in (10_000_000, 12_000):  # resident (native gradients) and offloading
        gem = GeminiDDP(_Net(True), device_memory_budget=budget, chunk_size=512, prefetch=0)
        opt = GeminiOptimizer(torch.optim.SGD(gem.parameters(), lr=0.1), gem)
        for _ in range(3):
            opt.backward(gem(torch.randn(4, 16)).square().mean())
            opt.step()
            opt.zero_grad()
        refs += [weakref.ref(gem), weakref.ref(gem.module)]
        del gem, opt
    gc.collect()
    assert [r() for r in refs] == [None] * 4
