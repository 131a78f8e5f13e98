"""Belady's rule on the traced sequence is optimal: checked against brute force on small random traces."""

import functools
import random

import pytest

from colossal.gemini import belady


def _brute_force(accesses, capacity):
    """Minimal fetches over every eviction choice (demand paging), by dynamic programming over resident sets."""

    @functools.cache
    def best(i, held):
        if i == len(accesses):
            return 0
        need = accesses[i]
        cost = len(need - held)
        union = held | need
        extra = sorted(held - need)
        options = []
        for mask in range(1 << len(extra)):
            kept = need | frozenset(c for b, c in enumerate(extra) if mask >> b & 1)
            if len(kept) <= capacity[i] and kept <= union:
                options.append(best(i + 1, kept))
        return cost + min(options)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(40))
def test_belady_matches_brute_force(seed):
    rng = random.Random(seed)
    n_chunks, steps = rng.randint(3, 6), rng.randint(4, 9)
    accesses = [frozenset(rng.sample(range(n_chunks), rng.randint(1, 2))) for _ in range(steps)]
    capacity = [rng.randint(len(a), len(a) + 2) for a in accesses]  # varies per step, like budget - non-model
    assert belady(accesses, capacity).loads == _brute_force(tuple(accesses), tuple(capacity))


def test_steady_state_cycles_and_errors():
    accesses = [frozenset({0}), frozenset({1}), frozenset({2}), frozenset({1}), frozenset({0})]
    roomy = belady(accesses, [3] * 5, cycles=2)
    assert roomy.loads == 0 and roomy.evictions == 0  # everything stays after the first cycle
    tight = belady(accesses, [2] * 5, cycles=2)
    assert tight.loads == tight.evictions > 0
    with pytest.raises(ValueError, match="capacity"):
        belady([frozenset({0, 1})], [1])
