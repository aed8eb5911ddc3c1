"""The DeepSpeed hook's ``layernorm`` recomputation finds the pre-norms of every Hugging Face block
dsauto plans it for, one shared norm too (Falcon-7B, Command R, Phi-2), one per parallel branch
(Falcon-40B), and the planner refuses it where the model normalises after its branches (OLMo 2), which
the hook would refuse only when the model is handed to DeepSpeed."""

from __future__ import annotations

import json
import types
import warnings

import pytest

from dsauto.errors import DsautoError
from dsauto.runtime.layers import find_layers
from dsauto.runtime.recompute import _target
from dsauto.search.space import parse_recompute_modules
from dsauto.spec.hf import model_from_hf_config

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from hf_configs import CONFIGS  # tests/ is on sys.path through its conftest


def blocks(name: str):
    data = {**json.loads((CONFIGS / f"{name}.json").read_text()), "num_hidden_layers": 2}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = model_from_hf_config(data, name)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**data))
    return spec, find_layers(model)


@pytest.mark.parametrize("name, norms", [
    ("falcon-7b", ("input_layernorm",)), ("c4ai-command-r-v01", ("input_layernorm",)),
    ("phi-2", ("input_layernorm",)), ("falcon-40b", ("ln_attn", "ln_mlp")),
    ("phi-3-mini-4k", ("input_layernorm", "post_attention_layernorm"))])
def test_the_pre_norms_of_each_block_are_found(name, norms):
    spec, layers = blocks(name)
    block = layers.blocks[0]
    found = _target(block, 1, "layernorm", types.SimpleNamespace(model=spec), False)
    assert found == [getattr(block, n) for n in norms]
    assert len(found) == spec.norms_per_layer


def test_a_model_normalising_after_its_branches_is_refused_at_plan_time():
    spec, _ = blocks("olmo2-1124-7b")
    with pytest.raises(DsautoError, match="--recompute-modules layernorm: dsauto's DeepSpeed hook recomputes the "
                                          "norms before attention and the MLP"):
        parse_recompute_modules("layernorm", spec, "deepspeed")
    assert parse_recompute_modules("layernorm", spec, "megatron") == ("layernorm",)
    assert parse_recompute_modules("layernorm", spec, None) == ("layernorm",)  # engine auto: Megatron-core's plans


def test_llama4_experts_as_transformers_computes_them_are_refused_for_the_trainer():
    """transformers' Llama4TextMoe repeats every token for each of the 128 experts (a batched matmul
    over all of them), 128x the top-1 work priced: a plan for Hugging Face's Trainer is refused; one for
    Megatron-core is made."""
    from dsauto.api import make_plan

    spec = model_from_hf_config(json.loads((CONFIGS / "llama-4-maverick-text.json").read_text()), "maverick")
    assert spec.transformers_dense_experts
    with pytest.raises(DsautoError, match=r"each of its 128 experts on every token \(Llama 4's Llama4TextMoe\), "
                                          r"128x the top-1 work dsauto prices; plan without --for hf"):
        make_plan(spec, "h200", nodes=2, global_batch=64, seq_len=8192, hf_trainer=True)
