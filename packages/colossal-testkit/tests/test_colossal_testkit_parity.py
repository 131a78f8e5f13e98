"""The parity helpers fail when they should and the reference run is plain PyTorch."""

import pytest
import torch

from colossal.testkit import GPT, GPTConfig, assert_close, lm_loss, max_rel_err, random_batches, train_reference


def test_relative_error_checks():
    want = torch.ones(100)
    assert_close(want * (1 + 1e-7), want)
    with pytest.raises(AssertionError, match="relative error"):
        assert_close(want * (1 + 1e-4), want, "w")
    with pytest.raises(AssertionError, match="shape"):
        assert_close(torch.ones(10, 10), want)
    got = {"a.k_proj.bias": torch.zeros(3), "b": torch.full((3,), 2.0)}
    ref = {"a.k_proj.bias": torch.ones(3), "b": torch.full((3,), 1.0)}
    assert max_rel_err(got, ref) == pytest.approx(1.0)  # k_proj.bias left out
    assert max_rel_err(got, ref, skip=()) == pytest.approx(1.0)
    with pytest.raises(KeyError):
        max_rel_err({}, ref)


def test_train_reference_is_the_plain_loop():
    batches = random_batches(1, seed=1) * 3  # one batch thrice: the loss must fall
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    state, losses = train_reference(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, clip=1.0)
    torch.manual_seed(0)
    plain = GPT(GPTConfig())
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step, (x, y) in enumerate(batches):
        loss = lm_loss(plain(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        assert loss.item() == losses[step]
    assert all(torch.equal(state[k], v) for k, v in plain.state_dict().items())
    assert losses[-1] < losses[0]
