"""Selective recomputation applied by dsauto.megatron, and checked by Megatron-core on a CPU rank.

The CPU run recomputes the attention core (``core_attn``), the module of Korthikanti et al. 2022,
Sec. 5. The two other modules dsauto prices cannot run here: Megatron-core 0.16 recomputes the norms
(``layernorm``) only with Transformer Engine installed, and the test GPT's linear layers have biases,
whose MLP it cannot recompute (dsauto refuses both: dsauto.engines.rules.recompute_module_refusal and
dsauto.runtime.megatron.recompute_fields).
"""

from __future__ import annotations

import logging

import pytest
from megatron_launch import MICRO_BATCH, SEQ_LEN, TINY, launch, make_plan

pytest.importorskip("megatron.core")

from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import TransformerConfig

import dsauto.megatron as dm
from dsauto.cost.terms import megatron_loss_bytes_per_token
from dsauto.errors import DsautoError

pytestmark = [
    pytest.mark.filterwarnings("ignore:full scope is deprecated:UserWarning"),
    pytest.mark.filterwarnings("ignore:If you are using transformer_engine:UserWarning"),
]


def config_for(**kwargs) -> TransformerConfig:
    return TransformerConfig(**dm.transformer_config_kwargs(TINY), **kwargs)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("dsauto")]


def test_a_selective_plan_sets_megatrons_selective_granularity(caplog):
    config = dm.apply(make_plan(recompute_modules=("core_attn",)), config_for(recompute_granularity="full",
                                                                             recompute_method="block",
                                                                             recompute_num_layers=1))
    assert (config.recompute_granularity, config.recompute_modules) == ("selective", ["core_attn"])
    assert config.recompute_method is None and config.recompute_num_layers is None
    assert any("replaces the config's full recomputation" in m for m in warnings_of(caplog))


def test_selective_layers_megatron_cannot_express_get_more_recomputation_reported(caplog):
    some = make_plan(recompute_modules=("core_attn",))
    runs = [run for run in some.layers]
    runs[1] = type(runs[1])(**{**runs[1].__dict__, "last": 1})  # layer 1 alone, then layers 2-4
    runs.insert(2, type(runs[1])(**{**runs[1].__dict__, "first": 2, "last": 4, "recompute_modules": ()}))
    mixed = type(some)(**{**some.__dict__, "layers": tuple(runs)})
    config = dm.apply(mixed, config_for())
    assert (config.recompute_granularity, config.recompute_modules) == ("selective", ["core_attn"])
    assert any("recomputes core_attn in layer 1 only" in m for m in warnings_of(caplog))
    caplog.clear()
    # With a whole layer checkpointed too, the selective layer is checkpointed whole as well.
    with_full = make_plan(checkpoint=(1,))
    runs = list(with_full.layers)
    runs[2] = type(runs[2])(**{**runs[2].__dict__, "recompute_modules": ("core_attn",)})
    config = dm.apply(type(with_full)(**{**with_full.__dict__, "layers": tuple(runs)}), config_for())
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == (
        "full", "block", 4)
    assert any("checkpoints those whole too" in m for m in warnings_of(caplog))


def test_norm_recomputation_needs_transformer_engine():
    plan = make_plan(recompute_modules=("layernorm",))
    if mcore_random.HAVE_TE:
        assert dm.apply(plan, config_for()).recompute_modules == ["layernorm"]
    else:
        with pytest.raises(DsautoError, match="only with Transformer Engine installed"):
            dm.apply(plan, config_for())


def test_a_flash_plan_on_unfused_attention_adds_the_attention_core(caplog):
    plan = make_plan(recompute_modules=("core_attn",), flash_attention=True)
    assert dm.apply(plan, config_for(attention_backend=AttnBackend.local)).recompute_modules == ["core_attn"]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict[str, dict]:
    return launch(1, {"none": {"plan": make_plan(), "measure": True},
                      "core_attn": {"plan": make_plan(recompute_modules=("core_attn",)), "measure": True}},
                  tmp_path_factory.mktemp("selective"))


def test_attention_core_recomputation_keeps_losses_bit_for_bit(one_rank):
    assert one_rank["core_attn"]["recompute"] == ["selective", None, None]
    assert one_rank["core_attn"]["losses"] == one_rank["none"]["losses"]


@pytest.mark.parametrize("run", ["none", "core_attn"])
def test_kept_bytes_are_the_predicted_ones(one_rank, run):
    # The worker counts every tensor autograd keeps in forward, the loss's fp32 softmax among them
    # (vocabulary x 4 bytes per token), which the model counts with the head's transients
    # (megatron_loss_bytes_per_token); the transformer layers' kept bytes are the plan's prediction.
    plan = make_plan(recompute_modules=("core_attn",) if run == "core_attn" else ())
    tokens = MICRO_BATCH * SEQ_LEN
    predicted = plan.stages[0].activation_bytes + tokens * megatron_loss_bytes_per_token(
        plan.padded_vocab_size, 1, 4)
    [measured] = one_rank[run]["saved_bytes"]
    assert measured == pytest.approx(predicted, rel=0.10)
    print(f"{run}: measured {measured} bytes kept per micro-batch, predicted {predicted}")


def test_recomputing_the_core_saves_its_scores(one_rank):
    # Korthikanti et al. 2022, Sec. 5: the fp32 attention probabilities, b x a x s^2 x 4 bytes a layer
    # (no dropout in the test GPT); the model's saving is exactly that.
    scores = TINY.num_layers * MICRO_BATCH * TINY.num_attention_heads * SEQ_LEN ** 2 * 4
    measured = one_rank["none"]["saved_bytes"][0] - one_rank["core_attn"]["saved_bytes"][0]
    predicted = make_plan().stages[0].activation_bytes - make_plan(recompute_modules=("core_attn",)).stages[0].activation_bytes
    assert predicted == scores
    assert measured == pytest.approx(predicted, rel=0.10)
