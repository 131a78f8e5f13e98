"""Budget errors raised during training name the module whose operator ran out of room (not
"operator 19") and suggest settings that help in the configuration in force: ``prefetch`` when
chunks are prefetched, never ``placement='auto'`` when auto is already in use. The budget is
lowered after warm-up to force the error in a steady-state step."""

import pytest
import torch
import torch.distributed as dist

from colossal.comm.testing import run_distributed
from colossal.gemini import BudgetExceededError, GeminiDDP, GeminiOptimizer
from colossal.testkit import GPT, GPTConfig, lm_loss, random_batches


def _steady_state_error(placement="auto", **kw):
    torch.manual_seed(0)
    gem = GeminiDDP(
        GPT(GPTConfig(init="torch")), device_memory_budget=10_000_000, chunk_size=8192, placement=placement, **kw
    )
    opt = GeminiOptimizer(torch.optim.AdamW(gem.parameters(), lr=1e-2), gem)
    (x, y), (x2, y2) = random_batches(2, batch=2, seq=8)
    opt.backward(lm_loss(gem(x), y))
    opt.step()  # warm-up done: the trace drives placement from here on
    gem.manager.device.budget = gem.manager.device.used_bytes + 40_000
    try:
        opt.backward(lm_loss(gem(x2), y2))
    except BudgetExceededError as e:
        return str(e)
    return None


@pytest.mark.parametrize("placement", ["auto", "static"])
def test_single_process_error_names_the_module_and_helpful_settings(placement):
    msg = _steady_state_error(placement)
    assert msg is not None
    assert "operator" in msg and ("(fwd:" in msg or "(bwd:" in msg), msg
    assert "prefetch" not in msg  # nothing is prefetched without sharding
    if placement == "auto":
        assert "placement='auto'" not in msg, msg
    else:
        assert "offload_param_frac" in msg and "placement='auto'" in msg, msg


def _rank():
    msg = _steady_state_error(prefetch=2)
    dist.barrier()
    return msg


def test_sharded_error_suggests_prefetch():
    for msg in run_distributed(_rank, 2, timeout=120):
        assert msg is not None
        assert "lower prefetch (now 2" in msg and "placement='auto'" not in msg, msg
        assert "(fwd:" in msg or "(bwd:" in msg, msg
