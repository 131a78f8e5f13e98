"""Modules that own parameters *and* call children (``[Note: parent modules]`` in ``ddp.py``).

A parent's pre-backward hook may fire before a child's backward has run (the child's output is the
parent's output), or the parent's own backward ops may run after a child's operator began. Gemini
must keep such chunks on the device until their gradients arrive. Reference: the same module in
plain PyTorch; tolerance fp32 1e-5 relative (same ops, gradients copied through chunk buffers).
"""

import pytest
import torch
from torch import nn

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
