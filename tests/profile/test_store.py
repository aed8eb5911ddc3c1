"""The profile store: keyed files, reuse, interpolation, and the cost model reading measured costs."""

import dataclasses

import pytest

from dsauto.cost.step import predict_step
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.errors import DsautoError
from dsauto.parallel import ParallelDims
from dsauto.profile.layers import LayerMeasurement
from dsauto.profile.store import (
    Profile,
    find_profile,
    load_profile,
    profile_path,
    save_profile,
    software_versions,
)
from dsauto.search.planner import Planner
from dsauto.spec.loaders import load_cluster, load_model
from dsauto.spec.training import TrainSpec

SEQ = 256


def _measurement(group, micro_batch, checkpoint=False, tp=1, scale=1.0):
    return LayerMeasurement(group=group, tp=tp, micro_batch=micro_batch, checkpoint=checkpoint,
                            forward_seconds=scale * (0.001 + 0.002 * micro_batch),
                            backward_seconds=scale * (0.002 + 0.004 * micro_batch + (0.003 * micro_batch if checkpoint else 0)),
                            activation_bytes=(1000 if checkpoint else 50_000) * micro_batch,
                            peak_bytes=80_000 * micro_batch, params_bytes=4096)


def _profile(model, micro_batches=(1, 4), **overrides):
    layers = []
    for b in micro_batches:
        layers += [_measurement("embedding", b, scale=0.1), _measurement("head", b, scale=0.5),
                   _measurement(model.architecture, b), _measurement(model.architecture, b, checkpoint=True)]
    fields = dict(model=model, device="cpu", dtype="fp32", seq_len=SEQ, threads=1,
                  versions=software_versions(), layers=tuple(layers), optimizer_seconds_per_param=2e-9)
    fields.update(overrides)
    return Profile(**fields)


@pytest.fixture
def tiny():
    return load_model("gpt-tiny")


def test_profiles_round_trip_through_the_store_under_their_key(tmp_path, tiny):
    profile = _profile(tiny)
    path = save_profile(profile, tmp_path)
    assert path == profile_path(tmp_path, tiny, "cpu", "fp32", SEQ, profile.versions)
    assert path.name.startswith("gpt-tiny-cpu-fp32-s256-")
    assert load_profile(path) == profile
    assert find_profile(tmp_path, tiny, "fp32", SEQ) == profile
    # Another model, dtype, sequence length or software version is another key.
    other = profile_path(tmp_path, tiny, "cpu", "fp32", SEQ, {**profile.versions, "torch": "0.0"})
    assert other != path


def test_a_missing_or_unmatched_profile_is_one_clear_error(tmp_path, tiny):
    with pytest.raises(DsautoError, match="does not exist; run `dsauto profile"):
        find_profile(tmp_path / "nowhere", tiny, "fp32", SEQ)
    save_profile(_profile(tiny), tmp_path)
    with pytest.raises(DsautoError, match="No profile in .* matches gpt-tiny in fp32 with sequences of 128"):
        find_profile(tmp_path, tiny, "fp32", 128)


def test_a_profile_of_another_device_or_software_is_refused_or_named(tmp_path, tiny):
    """A CPU profile prices no GPU plan (nor a GPU profile a CPU one); one of another GPU, or measured
    under other software versions, is used and named; a factory's profile is a key of its own."""
    import warnings

    from dsauto.errors import DsautoWarning

    save_profile(_profile(tiny), tmp_path / "cpu")
    with pytest.raises(DsautoError, match=r"profile was measured on cpu, and the plan is for H100-SXM5-80GB; "
                                          r"profile on the plan's device"):
        find_profile(tmp_path / "cpu", tiny, "fp32", SEQ, cluster=load_cluster("h100-80gb"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DsautoWarning)
        assert find_profile(tmp_path / "cpu", tiny, "fp32", SEQ, cluster=load_cluster("cpu")).device == "cpu"
    save_profile(_profile(tiny, device="NVIDIA A100-SXM4-80GB"), tmp_path / "a100")
    with pytest.warns(DsautoWarning, match=r"measured on NVIDIA A100-SXM4-80GB, and the plan is for H100-SXM5-80GB: "
                                           r"its layer times are the A100's"):
        find_profile(tmp_path / "a100", tiny, "fp32", SEQ, cluster=load_cluster("h100-80gb"))
    old = _profile(tiny, versions={**software_versions(), "torch": "0.0.1"})
    save_profile(old, tmp_path / "old")
    with pytest.warns(DsautoWarning, match=r"measured under other software versions \(torch 0\.0\.1 \(now "):
        find_profile(tmp_path / "old", tiny, "fp32", SEQ, cluster=load_cluster("cpu"))
    # a CPU profile timed with every core prices ranks that share them: named
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    save_profile(_profile(tiny, threads=cores + 1), tmp_path / "threads")
    with pytest.warns(DsautoWarning, match=r"timed each layer with \d+ threads, and the plan runs 2 ranks on these "
                                           r"\d+ cores \(\d+ a rank\), so its layers run slower than priced"):
        find_profile(tmp_path / "threads", tiny, "fp32", SEQ, cluster=load_cluster("cpu", gpus_per_node=2))
    assert profile_path(tmp_path, tiny, "cpu", "fp32", SEQ, factory="mine:layers") != profile_path(
        tmp_path, tiny, "cpu", "fp32", SEQ)


def test_estimates_interpolate_and_extrapolate_linearly_in_the_micro_batch(tiny):
    profile = _profile(tiny, micro_batches=(1, 4))
    exact = profile.estimate("decoder", 1, 4, False)
    assert exact == profile.measurement("decoder", 1, 4, False)
    two = profile.estimate("decoder", 1, 2, False)
    assert two.forward_seconds == pytest.approx(0.001 + 0.002 * 2)
    assert two.activation_bytes == 100_000
    eight = profile.estimate("decoder", 1, 8, True)
    assert eight.backward_seconds == pytest.approx(0.002 + 0.007 * 8)
    assert profile.estimate("decoder", 2, 1, False) is None  # TP 2 was not measured


def _predict(tiny, profile, zero=1, micro_batch=2, checkpoint=False):
    cluster = load_cluster("cpu", nodes=1, gpus_per_node=2)
    train = TrainSpec(global_batch=2 * micro_batch, seq_len=SEQ, dtype="fp32")
    strategy = Strategy(dims=ParallelDims(dp=2, tp=1, pp=1), zero_stage=zero, micro_batch=micro_batch, grad_accum=1,
                        sequence_parallel=False)
    options = [LayerOption(checkpoint and 1 <= i <= tiny.num_layers, False, 1) for i in range(tiny.num_layers + 2)]
    return predict_step(tiny, cluster, train, strategy, [tiny.num_layers], options, profile)


def test_the_cost_model_prices_measured_layers_from_the_profile(tiny):
    profile = _profile(tiny)
    analytic, measured = _predict(tiny, None), _predict(tiny, profile)
    assert analytic.prediction.basis == "analytic" and analytic.prediction.profile == ""
    assert measured.prediction.basis == "measured" and measured.stages[0].basis == "measured"
    assert measured.prediction.profile.startswith("gpt-tiny-cpu-fp32-s256-")
    stage = measured.stages[0]
    b = 2
    expected_forward = (0.1 + 0.5 + tiny.num_layers) * (0.001 + 0.002 * b)
    assert stage.forward_seconds == pytest.approx(expected_forward)
    # Transformer activations come from the profile too (4 layers x 50 kB x micro-batch 2) ...
    decoder_activations = tiny.num_layers * 50_000 * b
    assert stage.activation_bytes > decoder_activations
    assert stage.activation_bytes < decoder_activations + 2**20  # ... plus the analytic head
    ckpt = _predict(tiny, profile, checkpoint=True).stages[0]
    assert ckpt.activation_bytes < stage.activation_bytes
    assert ckpt.backward_seconds == pytest.approx(stage.backward_seconds + tiny.num_layers * 0.003 * b)
    # The optimizer is priced from the measured rate.
    assert measured.prediction.optimizer_seconds != analytic.prediction.optimizer_seconds


def test_a_profile_for_another_sequence_length_or_partial_coverage_falls_back(tiny):
    other_seq = _profile(tiny, seq_len=128)
    assert _predict(tiny, other_seq).prediction.basis == "analytic"
    partial = dataclasses.replace(_profile(tiny), layers=tuple(
        m for m in _profile(tiny).layers if m.group == "decoder"))
    assert _predict(tiny, partial).prediction.basis == "mixed"


def test_the_planner_searches_with_measured_costs(tiny):
    cluster = load_cluster("cpu", nodes=1, gpus_per_node=2)
    train = TrainSpec(global_batch=8, seq_len=SEQ, dtype="fp32")
    plan = Planner(tiny, cluster, train, profile=_profile(tiny)).search()[0]
    assert plan.prediction.basis == "measured"


def test_zero3_pays_the_measured_hook_cost_per_module_and_again_when_recomputing(tiny):
    base = _profile(tiny)
    hooked = dataclasses.replace(base, zero3_module_seconds=1e-3, layer_modules={"1": 8})
    plain3, hooked3 = _predict(tiny, base, zero=3), _predict(tiny, hooked, zero=3)
    modules = tiny.num_layers * 8 + 2 * 4  # transformer layers, then the embedding and the head
    assert hooked3.stages[0].forward_seconds - plain3.stages[0].forward_seconds == pytest.approx(modules * 1e-3 / 2, rel=0.02)
    ckpt_plain, ckpt_hooked = _predict(tiny, base, zero=3, checkpoint=True), _predict(tiny, hooked, zero=3, checkpoint=True)
    extra_backward = ckpt_hooked.stages[0].backward_seconds - ckpt_plain.stages[0].backward_seconds
    assert extra_backward == pytest.approx((tiny.num_layers * 8 * 2 + 2 * 4) * 1e-3 / 2, rel=0.02)
    # Below ZeRO-3 nothing is hooked.
    assert _predict(tiny, hooked, zero=2).prediction.step_seconds == _predict(tiny, base, zero=2).prediction.step_seconds


def test_a_factory_that_fails_or_builds_no_module_is_one_sentence(tiny):
    """``--factory os:getcwd`` (a function of no argument) and one returning something else than a
    module are user errors, named with the factory, not internal errors."""
    import os

    import torch

    from dsauto.profile.run import profile_factory_layers

    for factory, said in ((os.getcwd, r"The model factory getcwd failed when called with the ModelSpec: TypeError"),
                          (lambda spec: "a model", r"returned a str, not a torch\.nn\.Module")):
        with pytest.raises(DsautoError, match=said):
            profile_factory_layers(tiny, factory, SEQ, (1,), torch.float32, torch.device("cpu"), 0, 1, None)
