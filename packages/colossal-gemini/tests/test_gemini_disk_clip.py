"""The disk tier under gradient clipping: ``grad_norm()`` between backward and ``step()`` and the
clipped step itself see every gradient, in memory or on disk, as plain PyTorch's
``clip_grad_norm_`` does.

Tolerance: fp32, the norm to 1e-6 relative (per-chunk norms composed in another order than torch's
per-parameter ones), losses and weights to 1e-5 (``assert_close``). The clip coefficient differs from
torch's by that rounding, so the key bias of attention is left out, as in ``test_gemini_dist.py``:
its true gradient is zero and Adam normalises rounding noise there (``colossal.testkit.parity``).
"""

import pytest
import torch

from colossal.gemini import GeminiDDP, GeminiOptimizer
from colossal.optim import ConstantLossScaler
from colossal.testkit import GPT, GPTConfig, assert_close, lm_loss, random_batches

STEPS, CLIP = 3, 0.05  # CLIP lies well below every step's gradient norm: each step clips
BASE = dict(placement="static", device_memory_budget=1 << 20)
GRADS_ON_DISK = dict(BASE, offload_param_frac=1.0, disk_param_frac=0.8, disk_grad_frac=0.8, disk_optim_frac=0.8)
# optimizer blocks streamed from disk while their gradients stay in memory
STATES_ON_DISK = dict(BASE, disk_optim_frac=1.0, disk_grad_frac=0.0)
MASTERS_AND_STATES_ON_DISK = dict(BASE, offload_param_frac=1.0, disk_param_frac=1.0, disk_optim_frac=1.0)


def _reference(batches):
    """Plain PyTorch AdamW with ``clip_grad_norm_``: (initial state, final state, losses, norms)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(init="torch"))
    init = {k: v.clone() for k, v in model.state_dict().items()}
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for x, y in batches:
        loss = lm_loss(model(x), y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return init, model.state_dict(), losses, norms


def _gemini(directory, init, kw, scale=1.0):
    model = GPT(GPTConfig(init="torch"))
    model.load_state_dict(init)
    gem = GeminiDDP(model, chunk_size=8192, disk_dir=str(directory), **kw)
    optim = torch.optim.AdamW(gem.parameters(), lr=1e-2)
    return gem, GeminiOptimizer(optim, gem, max_grad_norm=CLIP, loss_scaler=ConstantLossScaler(scale))


def _assert_weights(gem, ref_state) -> None:
    state = gem.state_dict()
    for k, v in ref_state.items():
        if not k.endswith("k_proj.bias"):
            assert_close(state[k], v, k)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return abs(got.item() - want.item()) / want.item()


def test_grad_norm_reads_the_gradients_on_disk_and_the_clipped_step_matches_pytorch(tmp_path):
    batches = random_batches(STEPS, batch=2, seq=8)
    init, ref_state, ref_losses, ref_norms = _reference(batches)
    gem, opt = _gemini(tmp_path, init, GRADS_ON_DISK)
    assert any("grad" in c.on_disk for c in gem.manager.chunks), "gradient blocks must live on disk"
    for (x, y), want_loss, want_norm in zip(batches, ref_losses, ref_norms, strict=True):
        loss = lm_loss(gem(x), y)
        opt.backward(loss)
        norm = opt.grad_norm()  # with I/O threads still writing the backward's gradient blocks
        assert want_norm > CLIP and _rel(norm, want_norm) < 1e-6, (norm, want_norm)
        assert opt.step()
        assert _rel(opt.last_grad_norm, norm) < 1e-6, "the step clips with the norm grad_norm() read"
        assert abs(loss.item() - want_loss) <= 1e-5 * abs(want_loss)
    _assert_weights(gem, ref_state)


@pytest.mark.parametrize(
    "kw, scale",
    [(STATES_ON_DISK, 1.0), (MASTERS_AND_STATES_ON_DISK, 1.0), (STATES_ON_DISK, 1024.0)],
    ids=["states", "masters+states", "states-loss-scale"],
)
def test_streamed_blocks_with_gradients_in_memory_are_unscaled_and_clipped_as_pytorch(tmp_path, kw, scale):
    batches = random_batches(STEPS, batch=2, seq=8)
    init, ref_state, ref_losses, ref_norms = _reference(batches)
    gem, opt = _gemini(tmp_path, init, kw, scale)
    chunks = gem.manager.chunks
    assert all(c.on_disk and "grad" not in c.on_disk for c in chunks), [c.on_disk for c in chunks]
    losses = []
    for (x, y), want_norm in zip(batches, ref_norms, strict=True):
        loss = lm_loss(gem(x), y)
        opt.backward(loss)
        assert _rel(opt.grad_norm(), want_norm) < 1e-6
        assert opt.step()
        assert _rel(opt.last_grad_norm, want_norm) < 1e-6
        losses.append(loss.item())
    assert_close(torch.tensor(losses), torch.tensor(ref_losses), "losses")
    _assert_weights(gem, ref_state)
