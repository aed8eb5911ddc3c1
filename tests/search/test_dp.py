"""The stage DP against a brute-force oracle on random small instances."""

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dsauto.search.dp import solve, solve_prefixes


def brute_force(time, memory, transient, budget, n=None):
    n = time.shape[0] if n is None else n
    best = float("inf")
    for choice in itertools.product(range(time.shape[1]), repeat=n):
        t = sum(time[j, o] for j, o in enumerate(choice))
        used = sum(memory[j, o] for j, o in enumerate(choice))
        peak = max([transient[j, o] for j, o in enumerate(choice)], default=0)
        if used + peak <= budget and t < best:
            best = t
    return best


@st.composite
def instances(draw):
    n = draw(st.integers(0, 5))
    k = draw(st.integers(1, 4))
    times = draw(st.lists(st.one_of(st.integers(1, 50).map(float), st.just(float("inf"))),
                          min_size=n * k, max_size=n * k))
    mems = draw(st.lists(st.integers(0, 12), min_size=n * k, max_size=n * k))
    trans = draw(st.lists(st.integers(0, 8), min_size=n * k, max_size=n * k))
    budget = draw(st.integers(0, 50))
    shape = (n, k)
    return (np.array(times, dtype=float).reshape(shape), np.array(mems).reshape(shape),
            np.array(trans).reshape(shape), budget)


@settings(max_examples=300, deadline=None)
@given(instances())
def test_solve_matches_brute_force(instance):
    time, memory, transient, budget = instance
    value, choice = solve(time, memory, transient, budget)
    assert value == brute_force(time, memory, transient, budget)
    if np.isfinite(value):
        # The returned choice achieves the value and fits.
        assert sum(time[j, o] for j, o in enumerate(choice)) == value
        used = sum(memory[j, o] for j, o in enumerate(choice))
        peak = max([transient[j, o] for j, o in enumerate(choice)], default=0)
        assert used + peak <= budget


@settings(max_examples=150, deadline=None)
@given(instances(), st.data())
def test_every_prefix_matches_brute_force(instance, data):
    time, memory, transient, _ = instance
    n = time.shape[0]
    budgets = np.array(data.draw(st.lists(st.integers(0, 40), min_size=n + 1, max_size=n + 1)))
    solution = solve_prefixes(time, memory, transient, budgets)
    for j in range(n + 1):
        expected = brute_force(time, memory, transient, budgets[j], n=j)
        assert solution.best_time[j] == expected
        if np.isfinite(expected):
            choice = solution.choices(j)
            assert len(choice) == j
            assert sum(time[i, o] for i, o in enumerate(choice)) == expected


def test_tight_budget_forces_the_cheaper_memory_option():
    # Two layers, option 0 fast and big, option 1 slow and small.
    time = np.array([[1.0, 3.0], [1.0, 3.0]])
    memory = np.array([[5, 1], [5, 1]])
    transient = np.zeros((2, 2), dtype=int)
    assert solve(time, memory, transient, 10) == (2.0, (0, 0))
    assert solve(time, memory, transient, 6)[0] == 4.0
    assert solve(time, memory, transient, 2) == (6.0, (1, 1))
    assert solve(time, memory, transient, 1)[0] == float("inf")


def test_transient_peak_counts_once_not_per_layer():
    time = np.array([[1.0], [1.0], [1.0]])
    memory = np.array([[1], [1], [1]])
    transient = np.array([[4], [4], [4]])
    assert solve(time, memory, transient, 7)[0] == 3.0  # 3 + max(4) = 7
    assert solve(time, memory, transient, 6)[0] == float("inf")


def test_transient_and_budget_need_not_be_whole_units():
    """Only the memory that adds up is in whole units: a peak of 2 + 2.5 fits 4.5 exactly."""
    time = np.array([[1.0, 5.0], [1.0, 5.0]])
    memory = np.array([[1, 0], [1, 0]])
    transient = np.array([[2.5, 0.25], [2.5, 0.25]])
    assert solve(time, memory, transient, 4.5) == (2.0, (0, 0))
    assert solve(time, memory, transient, 4.49)[0] == 6.0  # one layer gives up its memory
    assert solve(time, memory, transient, 0.25) == (10.0, (1, 1))
    assert solve(time, memory, transient, 0.2)[0] == float("inf")
