"""The 1F1B simulation against the closed form and a brute-force fixed point."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsauto.cost.pipeline import one_f_one_b_order, pipeline_seconds, simulate_1f1b


def makespan(ops):
    return max(stage[-1][3] for stage in ops)


def dependency(kind, stage, micro_batch, stages):
    """The operation that must end before this one may start (None for stage 0's forwards)."""
    if kind == "F":
        return ("F", stage - 1, micro_batch) if stage > 0 else None
    return ("B", stage + 1, micro_batch) if stage < stages - 1 else ("F", stage, micro_batch)


def brute_force(forward, backward, micro_batches):
    """Start and end of every operation as the least fixed point of start = max(stage free, input
    ready), found by sweeping all operations until nothing changes (no event queue)."""
    stages = len(forward)
    orders = [one_f_one_b_order(i, stages, micro_batches) for i in range(stages)]
    ends = {(kind, i, j): 0.0 for i, order in enumerate(orders) for kind, j in order}
    changed = True
    while changed:
        changed = False
        for i, order in enumerate(orders):
            free = 0.0
            for kind, j in order:
                dep = dependency(kind, i, j, stages)
                start = max(free, ends[dep] if dep else 0.0)
                end = start + (forward[i] if kind == "F" else backward[i])
                if end != ends[(kind, i, j)]:
                    ends[(kind, i, j)], changed = end, True
                free = end
    return ends


def check_schedule(ops, forward, backward, micro_batches):
    """Every property of a 1F1B schedule that does not depend on the stage times being equal."""
    stages = len(forward)
    ends = {(kind, i, j): end for i, stage in enumerate(ops) for kind, j, _, end in stage}
    for i, stage in enumerate(ops):
        # Exactly m forwards and m backwards, in the 1F1B order, each taking the stage's time.
        assert sorted(j for kind, j, _, _ in stage if kind == "F") == list(range(micro_batches))
        assert sorted(j for kind, j, _, _ in stage if kind == "B") == list(range(micro_batches))
        assert [(kind, j) for kind, j, _, _ in stage] == one_f_one_b_order(i, stages, micro_batches)
        free, in_flight, most = 0.0, 0, 0
        for kind, j, start, end in stage:
            assert end == pytest.approx(start + (forward[i] if kind == "F" else backward[i]))
            assert start >= free - 1e-12, "operations of one stage overlap"
            dep = dependency(kind, i, j, stages)
            assert dep is None or start >= ends[dep] - 1e-12, f"{kind}{j} on stage {i} starts before {dep}"
            free = end
            in_flight += 1 if kind == "F" else -1
            most = max(most, in_flight)
        # Activations held at once: min(p - i, m) micro-batches (Narayanan et al. 2021, Sec. 2.2.1).
        assert most == min(stages - i, micro_batches)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("micro_batches", [1, 2, 3, 5, 8, 32])
def test_equal_stages_take_m_plus_p_minus_1_slots(stages, micro_batches):
    # Narayanan et al. 2021, Sec. 2.2: (m + p - 1) * (t_f + t_b), also when m < p.
    t_f, t_b = 0.3, 0.7
    ops = simulate_1f1b([t_f] * stages, [t_b] * stages, micro_batches)
    assert makespan(ops) == pytest.approx((micro_batches + stages - 1) * (t_f + t_b))
    check_schedule(ops, [t_f] * stages, [t_b] * stages, micro_batches)


@settings(max_examples=60, deadline=None)
@given(stages=st.integers(1, 8), micro_batches=st.integers(1, 12), t_f=st.floats(0.01, 5),
       t_b=st.floats(0.01, 5))
def test_closed_form_for_any_equal_stage_times(stages, micro_batches, t_f, t_b):
    ops = simulate_1f1b([t_f] * stages, [t_b] * stages, micro_batches)
    assert makespan(ops) == pytest.approx((micro_batches + stages - 1) * (t_f + t_b))


@settings(max_examples=80, deadline=None)
@given(data=st.data(), stages=st.integers(1, 7), micro_batches=st.integers(1, 10))
def test_uneven_stages_match_brute_force(data, stages, micro_batches):
    times = st.lists(st.floats(0.0, 3.0), min_size=stages, max_size=stages)
    forward, backward = data.draw(times), data.draw(times)
    ops = simulate_1f1b(forward, backward, micro_batches)
    check_schedule(ops, forward, backward, micro_batches)
    expected = brute_force(forward, backward, micro_batches)
    assert {(kind, i, j): end for i, stage in enumerate(ops) for kind, j, _, end in stage} == \
        pytest.approx(expected)


def test_one_stage_alternates_forward_and_backward():
    ops = simulate_1f1b([1.0], [2.0], 3)
    assert ops == [[("F", 0, 0.0, 1.0), ("B", 0, 1.0, 3.0), ("F", 1, 3.0, 4.0), ("B", 1, 4.0, 6.0),
                    ("F", 2, 6.0, 7.0), ("B", 2, 7.0, 9.0)]]


@pytest.mark.parametrize("forward, backward, micro_batches, match", [
    ([], [], 4, "one forward and one backward time per stage"),
    ([1.0, 1.0], [1.0], 4, "one forward and one backward time per stage"),
    ([1.0], [1.0], 0, "micro_batches must be at least 1"),
    ([1.0], [-1.0], 2, "must not be negative"),
])
def test_bad_inputs_are_refused(forward, backward, micro_batches, match):
    with pytest.raises(ValueError, match=match):
        simulate_1f1b(forward, backward, micro_batches)


def test_pipeline_seconds_is_the_simulated_makespan():
    forward, backward = [1.0, 2.0, 1.5], [2.0, 3.0, 2.5]
    assert pipeline_seconds(forward, backward, 6) == makespan(simulate_1f1b(forward, backward, 6))
    assert pipeline_seconds([1.0], [2.0], 5) == 15.0
