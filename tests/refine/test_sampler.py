"""The cost-model sampler on a real Optuna study, against a "true" machine that is the cost model
with other factors: it finds the truly fastest feasible candidate in few trials, never measures a
candidate twice, leaves other machines' running trials alone and retries interrupted ones."""

from __future__ import annotations

import optuna
import pytest

from dsauto.cost.calibration import Calibration
from dsauto.refine.sampler import (
    PEAK,
    STATUS,
    STEP,
    CostModelSampler,
    expected_improvement,
    key_of,
    knob_rules,
    suggest,
)
from dsauto.refine.space import Candidate, base_plans, calibrated_planner, candidates
from dsauto.refine.study import trial_pins
from dsauto.search.planner import Planner
from dsauto.search.space import Constraints
from dsauto.spec.loaders import load_cluster, load_model
from dsauto.spec.training import TrainSpec

optuna.logging.set_verbosity(optuna.logging.ERROR)


def problem(memory_limit=None):
    cluster = load_cluster("cpu", nodes=1, gpus_per_node=2, memory_limit=memory_limit)
    model, train = load_model("gpt-tiny"), TrainSpec(16, 256, "fp32")
    # The data-parallel DeepSpeed plans that trials measure through the dsauto hook (trial_pins).
    planner = Planner(model, cluster, train, trial_pins(Constraints()))
    space: list[Candidate] = []
    for zero in (0, 1, 2, 3):
        p = Planner(model, cluster, train, trial_pins(Constraints(zero_stage=zero)))
        try:
            space += candidates(p, base_plans(p, top_k=2))
        except Exception:  # a stage that fits nowhere under the limit
            continue
    unique = {key_of(c.knobs): c for c in space}
    return planner, list(unique.values())


# every collective 4x slower than priced: data-parallel, tensor-parallel and the pipeline's sends
TRUTH = Calibration(compute=1.3, communication=4.0, tensor_parallel=4.0, pipeline_p2p=4.0, zero3_hooks=1.0,
                    static_memory=1.05, activation_memory=1.25)


def run(planner, space, trials, truth=TRUTH):
    real = calibrated_planner(planner, truth)
    by_key = {key_of(c.knobs): c for c in space}
    sampler = CostModelSampler(space, planner)
    study = optuna.create_study(sampler=sampler)
    rules = knob_rules(space)

    def objective(trial):
        c = by_key[key_of(suggest(trial, rules))]
        got = c.price(real).prediction
        trial.set_user_attr(STEP, got.step_seconds)
        trial.set_user_attr(PEAK, got.peak_memory_bytes)
        feasible = got.peak_memory_bytes <= planner.cluster.memory_budget_bytes
        trial.set_user_attr(STATUS, "complete" if feasible else "infeasible")
        if not feasible:
            raise optuna.TrialPruned()
        return got.step_seconds

    for _ in range(trials):
        if sampler.propose(study) is None:
            break
        study.optimize(objective, n_trials=1)
    return study, sampler, real


def true_best(planner, space, real):
    feasible = [(c.price(real).prediction.step_seconds, key_of(c.knobs)) for c in space
                if c.price(real).prediction.peak_memory_bytes <= planner.cluster.memory_budget_bytes]
    return min(feasible)


def test_finds_the_truly_fastest_feasible_candidate_in_few_trials_without_repeats():
    # The "machine" holds 50% more static memory than priced: the model's favourite does not fit the
    # 33 MiB budget; another checkpointing of another plan does, and is the true optimum.
    planner, space = problem("33MiB")
    assert len(space) > 15
    truth = Calibration(compute=1.3, communication=4.0, tensor_parallel=4.0, pipeline_p2p=4.0, static_memory=1.5,
                        activation_memory=1.2)
    study, sampler, real = run(planner, space, trials=6, truth=truth)
    keys = [repr(sorted(t.params.items())) for t in study.trials]
    assert len(keys) == len(set(keys))  # no candidate measured twice
    assert study.trials[0].user_attrs[STATUS] == "infeasible"
    best_seconds, best_key = true_best(planner, space, real)
    assert study.best_value == pytest.approx(best_seconds)
    assert repr(sorted(study.best_trial.params.items())) == best_key
    assert sampler.calibration.static_memory > 1.3  # learnt that the "machine" needs more memory
    assert sampler.calibration.time_error_after < sampler.calibration.time_error_before


def test_the_first_trial_is_the_cost_models_choice():
    planner, space = problem(memory_limit=None)
    study, _, _ = run(planner, space, trials=1)
    predicted_best = min(space, key=lambda c: c.plan.prediction.step_seconds)
    assert key_of(predicted_best.knobs) == repr(sorted(study.trials[0].params.items()))


def test_running_trials_are_left_alone_and_interrupted_ones_are_retried():
    planner, space = problem(memory_limit=None)
    sampler = CostModelSampler(space, planner)
    study = optuna.create_study(sampler=sampler)
    first = sampler.propose(study)
    study.enqueue_trial(first.knobs.params())
    other = study.ask()  # another machine measuring the first choice
    suggest(other, knob_rules(space))
    assert key_of(sampler.propose(study).knobs) != key_of(first.knobs)
    other.set_user_attr(STATUS, "interrupted")
    study.tell(other, state=optuna.trial.TrialState.FAIL)
    assert key_of(sampler.propose(study).knobs) == key_of(first.knobs)


def test_expected_improvement():
    assert expected_improvement(1.0, 2.0, 0.0) == 0.0
    assert expected_improvement(2.0, 1.0, 0.0) == 1.0
    assert expected_improvement(1.0, 1.0, 0.1) == pytest.approx(0.1 / (2 * 3.141592653589793) ** 0.5)
    assert expected_improvement(1.0, 1.2, 0.1) < expected_improvement(1.0, 1.1, 0.1)
