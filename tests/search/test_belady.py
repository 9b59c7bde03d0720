"""Belady over set requests equals the exhaustive offline optimum on random small traces."""

from __future__ import annotations

import random
from functools import cache

import numpy as np
import pytest

pytest.importorskip("tierwise_search")

from tierwise_search.belady import AccessTrace, CacheTooSmall, simulate  # noqa: E402


def optimal_fetches(steps: list[frozenset[int]], n_blocks: int) -> int:
    """Fewest fetches over every eviction choice (exhaustive search, cold start).

    At each step all its chunks must be resident; any other resident chunks may be dropped.
    """

    @cache
    def best(index: int, resident: frozenset[int]) -> int:
        if index == len(steps):
            return 0
        need = steps[index]
        missing = need - resident
        others = sorted(resident - need)
        room = n_blocks - len(need)  # blocks left for chunks this step does not need
        result = None
        # keep any subset of the other resident chunks that fits beside this step's chunks
        for mask in range(1 << len(others)):
            kept = frozenset(c for bit, c in enumerate(others) if mask >> bit & 1)
            if len(kept) > room:
                continue
            cost = len(missing) + best(index + 1, need | kept)
            result = cost if result is None else min(result, cost)
        return result

    return best(0, frozenset())


def random_steps(rng: random.Random, n_chunks: int, n_steps: int, widest: int) -> list[list[int]]:
    return [rng.sample(range(n_chunks), rng.randint(1, widest)) for _ in range(n_steps)]


@pytest.mark.parametrize("seed", range(40))
def test_belady_equals_exhaustive_optimum(seed):
    rng = random.Random(seed)
    n_chunks = rng.randint(2, 6)
    widest = rng.randint(1, min(3, n_chunks))
    steps = random_steps(rng, n_chunks, rng.randint(3, 12), widest)
    trace = AccessTrace.from_steps(steps, n_chunks)
    frozen = [frozenset(s) for s in steps]
    for n_blocks in range(max(len(s) for s in frozen), n_chunks + 1):
        result = simulate(trace, n_blocks)
        assert result.total_fetches == optimal_fetches(frozen, n_blocks), (steps, n_blocks)


@pytest.mark.parametrize("seed", range(10))
def test_subset_of_chunks_equals_optimum_on_the_filtered_trace(seed):
    rng = random.Random(100 + seed)
    n_chunks = 6
    steps = random_steps(rng, n_chunks, 10, 2)
    cached = np.array([rng.random() < 0.6 for _ in range(n_chunks)])
    filtered = [frozenset(c for c in s if cached[c]) for s in steps]
    filtered = [s for s in filtered if s]
    trace = AccessTrace.from_steps(steps, n_chunks)
    n_blocks = max((len(s) for s in filtered), default=0)
    result = simulate(trace, max(n_blocks, 1), cached)
    assert not result.fetches[~cached].any()
    assert result.total_fetches == optimal_fetches(filtered, max(n_blocks, 1))


def test_fetch_counts_on_a_hand_trace():
    # forward 0,1,2,3 then backward 3,2,1,0 with 2 blocks: 4 cold fetches, 3 and 2 still
    # resident at the turn, then 1 and 0 again
    steps = [[0], [1], [2], [3], [3], [2], [1], [0]]
    result = simulate(AccessTrace.from_steps(steps, 4), 2)
    assert result.fetches.tolist() == [2, 2, 1, 1]


def test_more_blocks_never_fetch_more():
    rng = random.Random(7)
    steps = random_steps(rng, 30, 200, 3)
    trace = AccessTrace.from_steps(steps, 30)
    totals = [simulate(trace, n).total_fetches for n in range(3, 31)]
    assert totals == sorted(totals, reverse=True)
    assert totals[-1] == len({c for s in steps for c in s})  # everything fits: cold misses only


def test_a_step_wider_than_the_cache_is_an_error():
    with pytest.raises(CacheTooSmall, match="needs 3 chunks resident at once but the rCache has 2"):
        simulate(AccessTrace.from_steps([[0, 1, 2]], 3), 2)


def test_grads_final_at_is_the_share_of_backward_done_at_a_chunks_last_backward_step():
    # forward: [0], [1, 2], [0]; backward: [0], [2], [1, 2], [0]; chunk 3 is never used
    steps = [[0], [1, 2], [0], [0], [2], [1, 2], [0]]
    trace = AccessTrace.from_steps(steps, 4, backward_start=3)
    assert trace.grads_final_at().tolist() == [1.0, 0.75, 0.75, 1.0]
    # a trace without a forward/backward boundary counts every step as backward
    assert AccessTrace.from_steps([[0], [1]], 2).grads_final_at().tolist() == [0.5, 1.0]
