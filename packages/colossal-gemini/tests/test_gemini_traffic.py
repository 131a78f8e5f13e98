"""Traffic: the auto policy's bytes per steady-state step vs the Belady optimum and static offload."""

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from gemini_helpers import reference_gpt_run, train_gemini  # noqa: E402

from colossal.testkit import random_batches  # noqa: E402

BUDGET = 250_000


def test_auto_moves_no_more_than_static_and_stays_near_belady():
    batches = random_batches(4, batch=1, seq=8)
    init, _, _ = reference_gpt_run(batches[:1])
    auto, _ = train_gemini(batches, init, placement="auto", device_memory_budget=BUDGET)
    static, _ = train_gemini(
        batches, init, placement="static", device_memory_budget=BUDGET, offload_param_frac=1.0, offload_optim_frac=1.0
    )
    auto_bytes = auto.stats_history[-1].bytes_moved
    static_bytes = static.stats_history[-1].bytes_moved
    optimum = auto.stats_history[-1].belady_bytes
    assert auto_bytes > 0  # the budget really forces movement
    assert auto_bytes <= static_bytes
    assert auto_bytes <= 1.5 * optimum
    assert auto.stats_history[-1].bytes_moved == auto.stats_history[-2].bytes_moved  # steady state


def test_released_chunk_buffers_are_reused_within_the_budget(monkeypatch):
    """[Note: the chunk-buffer pool] in ``tiers.py``: on the CPU a fetch reuses a released chunk's
    buffer instead of mapping fresh pages; model data, pool and the policy's non-model reserve together
    never pass the budget; the
    training is the same as plain PyTorch's (fp32, 1e-5: the same ops through chunk buffers)."""
    from colossal.gemini.tiers import DeviceTier

    seen = {"reused": 0, "worst": 0}
    take, charge = DeviceTier.take_buffer, DeviceTier.charge

    def counted_take(self, nbytes):
        got = take(self, nbytes)
        seen["reused"] += got is not None
        return got

    def checked_charge(self, nbytes, what="model data"):
        charge(self, nbytes, what)
        seen["worst"] = max(seen["worst"], self.used_bytes + self.pooled_bytes + self.reserve_bytes - self.budget)

    monkeypatch.setattr(DeviceTier, "take_buffer", counted_take)
    monkeypatch.setattr(DeviceTier, "charge", checked_charge)
    batches = random_batches(4, batch=1, seq=8)
    init, final, losses = reference_gpt_run(batches)
    gem, got = train_gemini(batches, init, placement="auto", device_memory_budget=BUDGET)
    assert gem.stats_history[-1].bytes_moved > 0 and seen["reused"] > 0
    assert seen["worst"] <= 0  # model data, pool and the activations' reserve: never past the budget
    assert gem.manager.device.used_bytes + gem.manager.device.pooled_bytes <= BUDGET
    torch.testing.assert_close(torch.tensor(got), torch.tensor(losses), rtol=1e-5, atol=0)
    state = gem.state_dict()
    for k, v in final.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)
