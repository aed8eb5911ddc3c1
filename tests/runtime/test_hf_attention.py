"""The DeepSpeed hook refuses a transformers model whose attention keeps what its plan does not price."""

from __future__ import annotations

import pytest

from dsauto.api import make_plan
from dsauto.errors import DsautoError
from dsauto.runtime.deepspeed import prepare_model
from dsauto.spec.hf import model_from_hf_config

transformers = pytest.importorskip("transformers")

SEQ, BATCH = 64, 2
BASE = {"hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": SEQ, "head_dim": 32}


def test_a_transformers_model_with_eager_attention_is_refused_under_a_fused_attention_plan():
    # Eager attention keeps every layer's scores, which a plan priced with flash attention does not count.
    config = transformers.LlamaConfig(**BASE, attention_dropout=0.0)
    spec = model_from_hf_config(config.to_dict(), "tiny LlamaConfig", "tiny-llama")
    fused = make_plan(spec, "cpu", nodes=1, gpus_per_node=2, engine="deepspeed", global_batch=2 * BATCH,
                      seq_len=SEQ, dtype="fp32", micro_batch=BATCH)
    config._attn_implementation = "eager"
    with pytest.raises(DsautoError, match=r"computes attention eagerly .* re-plan with --no-flash-attention\.$"):
        prepare_model(fused, transformers.AutoModelForCausalLM.from_config(config))
    eager = make_plan(spec, "cpu", nodes=1, gpus_per_node=2, engine="deepspeed", global_batch=2 * BATCH,
                      seq_len=SEQ, dtype="fp32", micro_batch=BATCH, flash_attention=False)
    prepare_model(eager, transformers.AutoModelForCausalLM.from_config(config))  # priced with the scores
    config._attn_implementation = "sdpa"
    prepare_model(fused, transformers.AutoModelForCausalLM.from_config(config))
