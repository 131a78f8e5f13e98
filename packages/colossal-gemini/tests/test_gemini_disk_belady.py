"""The offline two-level optimum (device <- host <- disk) equals a brute force over every two-level
schedule on small random traces, and bounds the disk traffic of the policies."""

import functools
import itertools
import random

import pytest

from colossal.gemini import belady
from colossal.gemini.placement import belady_two_level


def _brute_each(accesses, dev_cap, host_cap):
    """Minima of the two objectives, each over all schedules (separate DPs)."""
    chunks = sorted(set().union(*accesses))

    def solve(objective):
        @functools.cache
        def best(i, dev, host):
            if i == len(accesses):
                return 0
            need = frozenset(accesses[i])
            others = [c for c in chunks if c not in need]
            res = None
            for k in range(0, dev_cap[i] - len(need) + 1):
                for extra in itertools.combinations(others, k):
                    d = need | frozenset(extra)
                    rest = [c for c in chunks if c not in d]
                    for h in range(0, min(host_cap, len(rest)) + 1):
                        for hs in itertools.combinations(rest, h):
                            hset = frozenset(hs)
                            cost = len((d | hset) - (dev | host)) if objective == "reads" else len(d - dev)
                            v = cost + best(i + 1, d, hset)
                            res = v if res is None else min(res, v)
            return res

        return best(0, frozenset(), frozenset())

    return solve("reads"), solve("loads")


@pytest.mark.parametrize("seed", range(12))
def test_two_level_optimum_equals_brute_force(seed):
    rng = random.Random(seed)
    n_chunks, steps = rng.randint(3, 5), rng.randint(4, 7)
    accesses = [frozenset(rng.sample(range(n_chunks), rng.randint(1, 2))) for _ in range(steps)]
    dev_cap = [rng.randint(2, 3) for _ in range(steps)]
    host_cap = rng.randint(0, 2)
    opt = belady_two_level(accesses, dev_cap, host_cap)
    reads, loads = _brute_each(accesses, dev_cap, host_cap)
    assert opt.disk_reads == reads
    assert opt.device_loads == loads
    assert opt.device_loads == belady(accesses, dev_cap).loads


def test_two_level_optimum_bounds_a_policy_that_spills_least_recently_used():
    rng = random.Random(7)
    for _ in range(30):
        n, steps = 8, 40
        accesses = [frozenset(rng.sample(range(n), rng.randint(1, 2))) for _ in range(steps)]
        dev_cap, host_cap = [3] * steps, 2
        # an online LRU schedule over device+host (reads counted when a chunk enters either level)
        cached, last, reads = [], {}, 0
        for i, need in enumerate(accesses):
            for c in need:
                if c not in cached:
                    reads += 1
                    cached.append(c)
                last[c] = i
            while len(cached) > dev_cap[i] + host_cap:
                victim = min((c for c in cached if c not in need), key=lambda c: last[c])
                cached.remove(victim)
        assert belady_two_level(accesses, dev_cap, host_cap).disk_reads <= reads
    with pytest.raises(ValueError, match="host_capacity"):
        belady_two_level([frozenset({0})], [1], -1)
