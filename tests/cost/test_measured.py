"""The profile satisfies the protocol through which the cost model and the search read it."""

import pytest

from dsauto.cost.measured import MeasuredCollective, MeasuredCosts, MeasuredLayer
from dsauto.profile.collectives import CollectiveFit
from dsauto.profile.layers import LayerMeasurement
from dsauto.profile.store import Profile, profile_key
from dsauto.spec.loaders import load_model

SEQ = 256


def _profile() -> Profile:
    """A profile built as tests/profile/test_store.py builds one, with a fitted collective."""
    model = load_model("gpt-tiny")
    layers = tuple(LayerMeasurement(group=group, tp=1, micro_batch=b, checkpoint=False,
                                    forward_seconds=0.001 * b, backward_seconds=0.002 * b,
                                    activation_bytes=50_000 * b, peak_bytes=80_000 * b, params_bytes=4096)
                   for b in (1, 4) for group in ("embedding", model.architecture, "head"))
    fit = CollectiveFit(op="all_reduce", group_size=2, scope="intra_node", latency_seconds=1e-5,
                        bandwidth_gbps=10.0, samples=((65536, 2e-5),))
    return Profile(model=model, device="cpu", dtype="fp32", seq_len=SEQ, threads=1,
                   versions={"torch": "2.0"}, layers=layers, optimizer_seconds_per_param=2e-9,
                   collectives=(fit,), zero3_module_seconds=1e-5, layer_modules={"1": 12})


def test_a_profile_is_measured_costs():
    profile = _profile()
    assert isinstance(profile, MeasuredCosts)
    assert isinstance(profile.estimate("decoder", 1, 2, False), MeasuredLayer)
    assert isinstance(profile.collective("all_reduce", 2, "intra_node"), MeasuredCollective)
    assert all(isinstance(fit, MeasuredCollective) for fit in profile.collectives)


def test_a_profile_is_named_by_its_store_key():
    profile = _profile()
    assert profile.key == profile_key(profile.model, "cpu", "fp32", SEQ, {"torch": "2.0"})


def test_an_object_missing_a_member_is_not_measured_costs():
    class NoEstimates:
        seq_len, dtype, calibration, collectives = SEQ, "fp32", None, ()

    assert not isinstance(NoEstimates(), MeasuredCosts)


def test_the_head_keeps_its_final_norm_as_measured_under_deepspeed():
    # The analytic count prices a fused final norm (its input and output); a profile that measured
    # the reference head's norm (LayerMeasurement.hidden_bytes) replaces it under DeepSpeed, whose
    # model it is, and not under Megatron-core, which runs its own.
    import dataclasses

    from dsauto.cost.layer import CostModel
    from dsauto.cost.strategy import LayerOption, Strategy
    from dsauto.parallel import ParallelDims
    from dsauto.spec.loaders import load_cluster
    from dsauto.spec.model import layer_groups
    from dsauto.spec.training import TrainSpec

    profile = _profile()
    measured_hidden = 123_456
    layers = tuple(dataclasses.replace(m, hidden_bytes=measured_hidden * m.micro_batch) if m.group == "head" else m
                   for m in profile.layers)
    profile = dataclasses.replace(profile, layers=layers)
    head = layer_groups(profile.model, SEQ, 4)[2]
    plain = LayerOption(checkpoint=False, shard_params=False, split=1)
    train = TrainSpec(global_batch=4, seq_len=SEQ, dtype="fp32")
    analytic = SEQ * 2 * head.act_replicated_bytes_per_token
    for engine, kept in (("deepspeed", 2 * measured_hidden), ("megatron", analytic)):
        strategy = Strategy(dims=ParallelDims(dp=2, tp=1, pp=1), zero_stage=1, micro_batch=2, grad_accum=1,
                            sequence_parallel=False, engine=engine)
        model = CostModel(load_cluster("cpu", nodes=1, gpus_per_node=2), train, strategy,
                          profile.model.hidden_size, profile)
        assert model.layer(head, plain).activation_bytes == pytest.approx(kept), engine
        assert model.layer(head, dataclasses.replace(plain, split=2)).activation_bytes == pytest.approx(kept), engine


def test_reference_layers_priced_for_megatron_core_lose_what_its_fused_kernels_do_not_keep():
    # A deepspeed profile measured dsauto's reference layers, whose RMSNorms and SwiGLU keep what
    # Hugging Face's do; Megatron-core's fused kernels keep the count's, so a Megatron-core plan
    # priced with such a profile takes the measurement less the unfused extras. A megatron profile
    # measured Megatron-core's own layer, which stands as measured; a DeepSpeed plan keeps it whole.
    import dataclasses

    from dsauto.cost.layer import CostModel
    from dsauto.cost.strategy import LayerOption, Strategy
    from dsauto.parallel import ParallelDims
    from dsauto.spec.loaders import load_cluster
    from dsauto.spec.model import layer_groups
    from dsauto.spec.training import TrainSpec

    reference = _profile()
    measured = 2 * 5_000_000  # a micro-batch of 2 sequences, more than the extras it holds
    reference = dataclasses.replace(reference, layers=tuple(
        dataclasses.replace(m, activation_bytes=measured // 2 * m.micro_batch) for m in reference.layers))
    llama = dataclasses.replace(reference.model, norm="rmsnorm", mlp="swiglu", position_embedding="rope",
                                linear_bias=False, tied_embeddings=False)
    block = layer_groups(llama, SEQ, 2, tp=1)[1]
    tokens = 2 * SEQ
    extra = tokens * block.unfused_bytes_per_token
    assert extra > 0
    plain = LayerOption(checkpoint=False, shard_params=False, split=1)
    train = TrainSpec(global_batch=4, seq_len=SEQ, dtype="bf16")
    assert extra < measured / 2
    for engine, profile, kept in (("megatron", reference, measured - extra),
                                  ("megatron", dataclasses.replace(reference, engine="megatron"), measured),
                                  ("deepspeed", reference, measured)):
        strategy = Strategy(dims=ParallelDims(dp=2, tp=1, pp=1), zero_stage=1, micro_batch=2, grad_accum=1,
                            sequence_parallel=False, engine=engine)
        cost = CostModel(load_cluster("cpu", nodes=1, gpus_per_node=2), train, strategy, llama.hidden_size,
                         dataclasses.replace(profile, dtype="bf16"))
        assert cost.layer(block, plain).activation_bytes == pytest.approx(kept), (engine, profile.engine)
