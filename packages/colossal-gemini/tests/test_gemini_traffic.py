"""Traffic: the auto policy's bytes per steady-state step vs the Belady optimum and static offload."""

import pathlib
import sys

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
