"""A profile for engine megatron times Megatron-core's own transformer layer (local spec), records
that it did, and is what a megatron plan is priced from; a profile of the reference layers is the
fallback, with a warning."""

import dataclasses
import warnings

import pytest
import torch
import torch.distributed as dist

from dsauto.api import find_plans, make_problem
from dsauto.profile.layers import profile_layers
from dsauto.profile.store import Profile, find_profile, load_profile, save_profile, software_versions
from dsauto.spec.loaders import load_model

pytest.importorskip("megatron.core")

SEQ = 64


@pytest.fixture(scope="module")
def tiny():
    return load_model("gpt-tiny")


@pytest.fixture(scope="module")
def both(tiny):
    def layers(engine):
        return {(m.group, m.tp, m.checkpoint): m for m in profile_layers(
            tiny, SEQ, micro_batches=(1,), tps=(1, 2), dtype=torch.float32, device=torch.device("cpu"),
            warmup=1, repeats=1, engine=engine)}
    initialized = dist.is_initialized()
    measured = layers("deepspeed"), layers("megatron")
    # A one-process group is set up for Megatron-core's layer only when there is none, and taken back.
    assert dist.is_initialized() == initialized
    return measured


def test_megatron_profile_times_megatron_cores_layer_at_every_tp_shard(tiny, both):
    reference, megatron = both
    assert reference.keys() == megatron.keys()
    for key, m in megatron.items():
        r = reference[key]
        assert m.forward_seconds > 0 and m.backward_seconds > 0
        # The same shard (1/tp of the heads and of the MLP), in other code.
        assert m.params_bytes == r.params_bytes, key
        if key[0] == tiny.architecture and not key[2]:
            # Megatron-core's unfused DotProductAttention keeps the s x s scores for backward;
            # the reference layer's flash attention does not.
            assert m.activation_bytes > r.activation_bytes, key
        elif key[0] != tiny.architecture:
            assert m.activation_bytes == r.activation_bytes, key  # the reference embedding and head


def test_megatron_profile_is_keyed_apart_and_found_for_megatron_plans(tmp_path, tiny, both):
    reference, megatron = both

    def profile(layers, engine):
        return Profile(model=tiny, device="cpu", dtype="fp32", seq_len=SEQ, threads=1,
                       versions=software_versions(), layers=tuple(layers.values()),
                       optimizer_seconds_per_param=1e-9, engine=engine)

    deepspeed_profile = profile(reference, "deepspeed")
    megatron_profile = profile(megatron, "megatron")
    assert deepspeed_profile.key != megatron_profile.key
    save_profile(deepspeed_profile, tmp_path / "both")
    assert load_profile(save_profile(megatron_profile, tmp_path / "both")).engine == "megatron"
    decoder = tiny.architecture
    found = find_profile(tmp_path / "both", tiny, "fp32", SEQ, "megatron")
    assert found.engine == "megatron"
    assert found.measurement(decoder, 1, 1, False) == megatron[(decoder, 1, False)]
    assert find_profile(tmp_path / "both", tiny, "fp32", SEQ, "deepspeed").engine == "deepspeed"
    assert find_profile(tmp_path / "both", tiny, "fp32", SEQ).engine == "deepspeed"

    save_profile(deepspeed_profile, tmp_path / "reference")
    with pytest.warns(UserWarning, match="no profile of megatron's layers"):
        assert find_profile(tmp_path / "reference", tiny, "fp32", SEQ, "megatron").engine == "deepspeed"

    # A plan priced from another engine's layers says so once, whether the profile was looked up or handed over.
    for given in (tmp_path / "reference", deepspeed_profile):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            [plan] = find_plans(make_problem(tiny, "cpu", seq_len=SEQ, dtype="fp32", engine="megatron"), profile=given)
        said = [str(w.message) for w in caught if "profile" in str(w.message)]
        assert plan.engine == "megatron" and len(said) == 1, said
        assert "The megatron plan is priced from a profile of deepspeed's layers" in said[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        find_plans(make_problem(tiny, "cpu", seq_len=SEQ, dtype="fp32", engine="megatron"), profile=megatron_profile)
        find_plans(make_problem(tiny, "cpu", seq_len=SEQ, dtype="fp32", engine="deepspeed"), profile=deepspeed_profile)


def test_a_profile_written_before_the_engine_field_reads_as_the_reference_layers(tmp_path, tiny, both):
    reference, _ = both
    profile = Profile(model=tiny, device="cpu", dtype="fp32", seq_len=SEQ, threads=1,
                      versions=software_versions(), layers=tuple(reference.values()),
                      optimizer_seconds_per_param=1e-9)
    data = profile.to_dict()
    del data["engine"]
    old = Profile.from_dict(data)
    assert old.engine == "deepspeed" and old.key == profile.key
    assert dataclasses.replace(old, engine="megatron").key != old.key


def test_swiglu_gqa_rope_shards_of_megatron_cores_layer_hold_the_reference_shards_parameters(tiny):
    llama = dataclasses.replace(tiny, name="tiny-llama", mlp="swiglu", norm="rmsnorm", position_embedding="rope",
                                num_kv_heads=2, linear_bias=False, tied_embeddings=False)

    def decoders(engine):
        return {(m.tp, m.checkpoint): m for m in profile_layers(
            llama, SEQ, micro_batches=(1,), tps=(1, 2), dtype=torch.float32, device=torch.device("cpu"),
            warmup=1, repeats=1, engine=engine) if m.group == llama.architecture}

    reference, megatron = decoders("deepspeed"), decoders("megatron")
    assert reference.keys() == megatron.keys() == {(t, c) for t in (1, 2) for c in (False, True)}
    for key, m in megatron.items():
        assert m.params_bytes == reference[key].params_bytes, key
        assert m.forward_seconds > 0 and m.backward_seconds > 0
