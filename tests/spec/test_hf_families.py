"""Hugging Face configs of every supported family: exact parameter counts, the fields read, and the
configs refused with one sentence.

The public configs are hand-written JSON files under tests/spec/configs/ (the values of each
model's config.json on the Hugging Face Hub, named in the file's ``_name_or_path``). Each count is
checked twice: exactly against the transformers model built from the same config on the meta
device (when transformers is installed), and against the published total.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from dsauto.errors import DsautoError, DsautoWarning
from dsauto.spec.hf import FAMILIES, model_from_hf_config
from dsauto.spec.loaders import load_model

CONFIGS = Path(__file__).with_name("configs")

# Published total parameters and where they are stated; the tolerance is the rounding of the
# published figure.
PUBLISHED = {
    "llama-3.1-8b": (8.03e9, 0.001, "Hugging Face model page of meta-llama/Llama-3.1-8B: 8.03B"),
    "llama-3.2-1b": (1.24e9, 0.005, "Hugging Face model page of meta-llama/Llama-3.2-1B: 1.24B"),
    "mistral-nemo-12b": (12.2e9, 0.005, "Mistral NeMo announcement and model page: 12.2B (the issue's example)"),
    "mistral-7b-v0.1": (7.24e9, 0.001, "Hugging Face model page of mistralai/Mistral-7B-v0.1: 7.24B"),
    "qwen2.5-7b": (7.61e9, 0.001, "Qwen2.5-7B model card: 'Number of Parameters: 7.61B'"),
    "qwen2.5-0.5b": (0.49e9, 0.01, "Qwen2.5-0.5B model card: 'Number of Parameters: 0.49B'"),
    "qwen3-8b": (8.2e9, 0.005, "Qwen3-8B model card: 'Number of Parameters: 8.2B'"),
    "qwen3-0.6b": (0.6e9, 0.01, "Qwen3-0.6B model card: 'Number of Parameters: 0.6B'"),
    "gemma-7b": (8.54e9, 0.001, "Hugging Face model page of google/gemma-7b: 8.54B"),
    "gemma-2b": (2.51e9, 0.002, "Hugging Face model page of google/gemma-2b: 2.51B"),
    "gemma-2-9b": (9.24e9, 0.001, "Hugging Face model page of google/gemma-2-9b: 9.24B"),
    "gemma-2-27b": (27.2e9, 0.002, "Hugging Face model page of google/gemma-2-27b: 27.2B"),
    "gemma-3-1b": (1.0e9, 0.001, "Gemma 3 technical report, Table 1: 1B (999.9M with the embedding)"),
    "phi-3-mini-4k": (3.8e9, 0.01, "Phi-3 technical report (Abdin et al. 2024): 3.8B"),
    "falcon-7b": (7e9, 0.02, "tiiuae/falcon-7b model card: 'a 7B parameters causal decoder-only model'"),
    "falcon-40b": (40e9, 0.04, "tiiuae/falcon-40b model card: 'a 40B parameters causal decoder-only model'"),
    "bloom-560m": (559_214_592, 0.0, "bigscience/bloom-560m model card: 559,214,592 parameters"),
    "gpt2": (124e6, 0.005, "Hugging Face model page of openai-community/gpt2: 124M"),
    "pythia-1b": (1_011_781_632, 0.0, "Biderman et al. 2023 (Pythia), Table 1: 1,011,781,632 total"),
    "gpt-neox-20b": (20_554_567_680, 0.0, "Black et al. 2022 (GPT-NeoX-20B), Sec. 2: 20,554,567,680"),
    "opt-1.3b": (1.3e9, 0.015, "Zhang et al. 2022 (OPT), Table 1: 1.3B"),
    "bert-base-uncased": (110e6, 0.01, "Devlin et al. 2019 (BERT), Sec. 3: BERT-BASE 110M"),
    "roberta-base": (125e6, 0.005, "Hugging Face model page of FacebookAI/roberta-base: 125M"),
    # mixtures of experts (every expert counted)
    "mixtral-8x7b": (46.7e9, 0.005, "Mixtral of experts announcement (mistral.ai, Dec. 2023): 46.7B total"),
    "deepseek-v3": (671e9, 0.005, "DeepSeek-V3 technical report, abstract: 671B total (the 14B MTP module apart)"),
    "deepseek-v2-lite": (15.7e9, 0.005, "DeepSeek-V2 paper, Appendix B: DeepSeek-V2-Lite 15.7B total"),
    "qwen3-30b-a3b": (30.5e9, 0.005, "Qwen3-30B-A3B model card: 30.5B in total"),
    "qwen1.5-moe-a2.7b": (14.3e9, 0.005, "Qwen1.5-MoE-A2.7B model card: 14.3B parameters in total"),
    "olmoe-1b-7b": (6.9e9, 0.005, "Muennighoff et al. 2024 (OLMoE), Sec. 1: 6.9B total"),
    "gpt-oss-20b": (20.91e9, 0.001, "gpt-oss model card (OpenAI 2025), Table 1: 20.91B total"),
    # families added later; where a publisher gives only its size class, the tolerance is that
    # class's rounding
    "ministral-8b-instruct-2410": (8_019_808_256, 0.0, "Ministral-8B-Instruct-2410 model card, architecture "
                                   "table: 'Parameters 8,019,808,256'"),
    "granite-3.1-8b-instruct": (8e9, 0.025, "model name and card (Granite-3.1-8B-Instruct): 8B, its size class"),
    "granite-3.0-3b-a800m-base": (3e9, 0.1, "model name and NeMo AutoModel's Granite MoE page: 3B total"),
    "olmo2-1124-7b": (7e9, 0.05, "OLMo 2 model card: 'a new family of 7B and 13B models'"),
    "olmo3-1025-7b": (7e9, 0.05, "Olmo 3 model card and paper (arXiv 2512.13961): 7B"),
    "smollm3-3b": (3e9, 0.03, "SmolLM3 model card: 'a 3B parameter language model'"),
    "glm-4-9b-chat-hf": (9e9, 0.05, "GLM-4 technical report (arXiv 2406.12793): GLM-4-9B"),
    "glm-4-32b-0414": (32e9, 0.02, "THUDM/GLM-4 README: 'GLM-4-32B-0414 series models, featuring 32 billion parameters'"),
    "glm-4.5-air": (106e9, 0.01, "zai-org/GLM-4.5 README: '106 billion total parameters' (106.85B without the "
                    "multi-token-prediction layer: the figure is truncated)"),
    "starcoder2-3b": (3e9, 0.011, "transformers' StarCoder2 page: 'sizes with 3B, 7B and 15B parameters'"),
    "gpt_bigcode-santacoder": (1.1e9, 0.025, "SantaCoder paper (Allal et al. 2023): a 1.1B parameter model"),
    "minitron-8b-base": (8e9, 0.035, "model name (Minitron-8B-Base): 8B, its size class"),
    "c4ai-command-r-v01": (35e9, 0.001, "c4ai-command-r-v01 model card: 'Model Size: 35 billion parameters'"),
    "c4ai-command-r7b-12-2024": (8.028e9, 0.001, "Open LLM Leaderboard's count of the checkpoint: 8.028B "
                                 "(the model card's '7B' is its size class)"),
    "phi-2": (2.7e9, 0.03, "phi-2 model card: 'a Transformer with 2.7 billion parameters'"),
    # MiniMax-M2's config.json as two public test fixtures spell it (a vLLM fork's MiniMax-M2.7
    # contract test and a Go loader's fixture agree on every shape key); its 228.7B are the main
    # model without the three multi-token-prediction modules
    "minimax-m2": (230e9, 0.01, "MiniMax-M2 model card: '230 billion total parameters with 10 billion active'"),
    # Llama 4 Maverick's text_config as TensorRT-LLM's Llama 4 test spells it (its
    # LLAMA_4_MAVERICK_TWO_LAYER_CONFIG, with the two values that test changes put back: 48 layers
    # and the default no_rope_layer_interval 4)
    "llama-4-maverick-text": (400e9, 0.002, "Meta's Llama 4 announcement: Maverick, 400B total parameters"),
    # Kimi K2's config.json (model_type kimi_k2: DeepSeek-V3's architecture through its auto_map)
    "kimi-k2": (1e12, 0.03, "MoonshotAI/Kimi-K2 README: '1 trillion total parameters'"),
    "seed-oss-36b": (36e9, 0.005, "Seed-OSS-36B model card: 36B"),
    "ernie-4.5-0.3b": (0.3e9, 0.21, "transformers' ERNIE 4.5 page: '0.3B parameters in total' (its size class; "
                       "0.36B counted)"),
    # transformers 5.24's Ernie4_5_MoeConfig defaults, which it documents as the ERNIE-4.5-21B-A3B style
    # configuration (configuration_ernie4_5_moe.py: auto_docstring checkpoint baidu/ERNIE-4.5-21B-A3B-PT)
    "ernie-4.5-21b-a3b": (21e9, 0.04, "model name (ERNIE-4.5-21B-A3B): 21B total, its size class (21.8B counted)"),
}

# Published active parameters: (count, tolerance, whether the publisher counts the input embedding,
# source). The tolerance is the publisher's rounding: Qwen writes 3.35B as "3.3B" and DeepSeek
# 37.55B as "37B", so those two are 1.6% and 1.5% from the rounded figure.
PUBLISHED_ACTIVE = {
    "mixtral-8x7b": (12.9e9, 0.005, True, "Mixtral announcement: 12.9B active parameters per token"),
    "deepseek-v3": (37e9, 0.016, True, "DeepSeek-V3 technical report: 37B activated for each token"),
    "qwen3-30b-a3b": (3.3e9, 0.017, True, "Qwen3-30B-A3B model card: 3.3B activated"),
    "qwen1.5-moe-a2.7b": (2.7e9, 0.005, True, "Qwen1.5-MoE-A2.7B model card: 2.7B activated"),
    "olmoe-1b-7b": (1.3e9, 0.015, True, "OLMoE paper, Sec. 1: 1.3B active"),
    "gpt-oss-20b": (3.61e9, 0.002, False, "gpt-oss model card, Table 1: 3.61B active (embedding excluded)"),
    # GLM's README does not say what it counts: 12.80B without the input embedding, 12.18B without
    # the output layer too; Granite's tied embedding matrix (75.5M) is counted once, as the head
    "glm-4.5-air": (12e9, 0.07, False, "zai-org/GLM-4.5 README: '12 billion active parameters'"),
    "granite-3.0-3b-a800m-base": (0.8e9, 0.11, False, "model name (A800M) and NeMo AutoModel's Granite MoE "
                                  "page: 800M active"),
    "minimax-m2": (10e9, 0.05, False, "MiniMax-M2 model card: '10 billion active' (10.42B without the input "
                   "embedding, 9.81B without the output layer too)"),
    "llama-4-maverick-text": (17e9, 0.011, True, "Meta's Llama 4 announcement: 17B active parameters"),
    "kimi-k2": (32e9, 0.03, True, "MoonshotAI/Kimi-K2 README: '32 billion activated parameters'"),
    "ernie-4.5-21b-a3b": (3e9, 0.12, True, "model name (A3B): 3B activated, its size class (3.35B counted, the "
                          "tied embedding matrix once)"),
}

REFUSED = {"t5-base": "encoder-decoder"}


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def load(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DsautoWarning)  # the public configs leave no key unread
        warnings.filterwarnings("ignore", ".*its multi-token-prediction modules", DsautoWarning)  # named on purpose
        warnings.filterwarnings("ignore", ".*its checkpoint is stored in", DsautoWarning)  # named on purpose
        return model_from_hf_config(config(name), name)


@pytest.mark.parametrize("name, layers", [("deepseek-v3", 1), ("glm-4.5-air", 1), ("deepseek-v2-lite", 0)])
def test_multi_token_prediction_layers_are_read(name, layers):
    """DeepSeek-V3's and GLM-4.5's configs add a multi-token-prediction layer (num_nextn_predict_layers),
    which Megatron-Bridge builds as Megatron-core's mtp_num_layers: read into the model, without a
    warning; a config without one has none."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DsautoWarning)
        model = model_from_hf_config(config(name), name)
    assert model.mtp_layers == layers
    assert not [w for w in caught if "multi-token-prediction" in str(w.message)]


def test_minimax_multi_token_prediction_modules_are_named_as_not_planned():
    """MiniMax-M2's multi-token-prediction modules (several layers each), which neither transformers nor
    dsauto builds, are named in a warning; its model plans without them."""
    given = {**config("minimax-m2"), "use_mtp": True, "num_mtp_modules": 3, "mtp_transformer_layers": 1}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DsautoWarning)
        model = model_from_hf_config(given, "minimax-m2")
    said = [str(w.message) for w in caught if "multi-token-prediction" in str(w.message)]
    assert said == ["minimax-m2: its multi-token-prediction modules (num_mtp_modules=3, use_mtp=True) are not "
                    "planned: transformers does not build them, and Megatron-core's --mtp-num-layers builds one "
                    "layer a depth, not these; the plan, its memory and its time are the main model's."]
    assert model.mtp_layers == 0


# Hub model types whose config transformers reads as another family's (the config's auto_map)
SAME_AS = {"kimi_k2": "deepseek_v3"}


def as_transformers(data: dict) -> dict:
    return {**data, "model_type": SAME_AS.get(data["model_type"], data["model_type"])}


def transformers_count(data: dict) -> int:
    """Parameters of the transformers model built from ``data`` on the meta device (no weights)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    data = as_transformers(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = transformers.AutoConfig.for_model(**data)
        # The masked-LM head is what dsauto plans for encoders (AutoModelForCausalLM would give
        # BERT's decoder variant, the same parameters).
        auto = (transformers.AutoModelForMaskedLM if data["model_type"] in ("bert", "roberta")
                else transformers.AutoModelForCausalLM)
        with torch.device("meta"):
            model = auto.from_config(cfg)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)  # ERNIE's frozen router bias apart


def test_every_config_file_is_checked():
    assert {p.stem for p in CONFIGS.glob("*.json")} == set(PUBLISHED) | set(REFUSED)
    families = {config(name)["model_type"] for name in PUBLISHED}
    # a public config of every family but GraniteMoeShared, whose one public checkpoint's config
    # (ibm-research/moe-7b-1b-active-shared-experts) no stored source spells out: it is counted
    # against transformers in VARIANTS
    # as are Arcee's and EXAONE 4's, whose public configs no stored source spells out whole
    variant_only = {"granitemoeshared", "arcee", "exaone4", "granitemoehybrid", "dots1", "ministral3", "glm4_moe_lite"}
    assert families == set(FAMILIES) - variant_only
    assert variant_only <= {changes.get("model_type") for _, changes in VARIANTS}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_count_matches_published(name):
    total, rel, _source = PUBLISHED[name]
    assert load(name).num_parameters() == pytest.approx(total, rel=rel, abs=0)


@pytest.mark.parametrize("name", sorted(PUBLISHED_ACTIVE))
def test_active_count_matches_published(name):
    active, rel, embedding, _source = PUBLISHED_ACTIVE[name]
    assert load(name).num_active_parameters(embedding=embedding) == pytest.approx(active, rel=rel, abs=0)


@pytest.mark.parametrize("name", sorted(PUBLISHED_ACTIVE))
def test_active_count_matches_transformers(name):
    """The transformers model's parameters less the routed experts a token skips: (E - k) / E of
    every module under an ``experts`` container."""
    transformers_count(config(name))  # skips without transformers
    import torch
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.for_model(**as_transformers(config(name))))
    spec = load(name)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    skipped = experts * (spec.num_experts - spec.moe_top_k) // spec.num_experts
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert spec.num_active_parameters() == trainable - skipped
    assert spec.num_active_parameters() < spec.num_parameters()


def test_dense_models_are_all_active():
    model = load("llama-3.1-8b")
    assert model.num_active_parameters() == model.num_parameters() and not model.moe_layers()


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_count_matches_transformers_exactly(name):
    assert load(name).num_parameters() == transformers_count(config(name))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_config_object_reads_like_its_json(name):
    """A transformers config object (``to_dict()``: transformers 5 spells rotary settings as
    ``rope_parameters`` and adds ``layer_types``) gives the same model as the Hub's config.json."""
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = transformers.AutoConfig.for_model(**as_transformers(config(name))).to_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DsautoWarning)
        warnings.filterwarnings("ignore", ".*its multi-token-prediction modules", DsautoWarning)  # named on purpose
        warnings.filterwarnings("ignore", ".*its checkpoint is stored in", DsautoWarning)  # named on purpose
        assert model_from_hf_config(data, name) == load(name)


# Variants of each family that switch its options, counted against transformers.
DROP = object()
"""A VARIANTS change that takes the key out of the config."""

VARIANTS = [
    ("llama-3.2-1b", {"attention_bias": True}),
    ("llama-3.2-1b", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False}),
    ("llama-3.2-1b", {"mlp_bias": True, "num_key_value_heads": 32, "head_dim": 96}),
    ("mistral-nemo-12b", {"head_dim": 160, "num_hidden_layers": 2}),
    ("qwen2.5-0.5b", {"tie_word_embeddings": False}),
    ("qwen3-0.6b", {"attention_bias": True, "head_dim": 64}),
    ("gemma-2b", {"attention_bias": True, "head_dim": 128}),
    ("gemma-3-1b", {"num_key_value_heads": 4, "head_dim": 128}),
    ("phi-3-mini-4k", {"num_key_value_heads": 8, "tie_word_embeddings": True}),
    ("falcon-7b", {"bias": True, "multi_query": False}),
    ("falcon-7b", {"parallel_attn": False}),
    ("falcon-40b", {"num_ln_in_parallel_attn": 1, "ffn_hidden_size": 20000, "num_hidden_layers": 2}),
    ("falcon-7b", {"alibi": True}),
    ("bloom-560m", {"n_layer": 3}),
    ("gpt2", {"n_inner": 1000, "tie_word_embeddings": False}),
    ("pythia-1b", {"attention_bias": False, "tie_word_embeddings": True}),
    ("opt-1.3b", {"enable_bias": False, "tie_word_embeddings": False}),
    ("opt-1.3b", {"do_layer_norm_before": False}),
    ("bert-base-uncased", {"type_vocab_size": 4, "max_position_embeddings": 1024}),
    ("roberta-base", {"pad_token_id": 0, "type_vocab_size": 2}),
    ("mixtral-8x7b", {"num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 1}),
    ("qwen3-30b-a3b", {"num_hidden_layers": 4, "mlp_only_layers": [0, 1], "attention_bias": True}),
    ("qwen1.5-moe-a2.7b", {"num_hidden_layers": 3, "shared_expert_intermediate_size": 1024}),
    ("deepseek-v3", {"num_hidden_layers": 5, "first_k_dense_replace": 1, "q_lora_rank": None}),
    ("deepseek-v2-lite", {"num_hidden_layers": 4, "first_k_dense_replace": 0, "q_lora_rank": 768}),
    ("gpt-oss-20b", {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"],
                     "attention_bias": False}),
    ("granite-3.1-8b-instruct", {"num_hidden_layers": 2, "attention_bias": True, "mlp_bias": True,
                                 "tie_word_embeddings": False}),
    ("olmo2-1124-7b", {"num_hidden_layers": 2, "attention_bias": True, "num_key_value_heads": 8}),
    ("olmo3-1025-7b", {"num_hidden_layers": 4, "num_key_value_heads": 4, "layer_types": None}),
    ("smollm3-3b", {"num_hidden_layers": 8, "no_rope_layers": None, "layer_types": None, "mlp_bias": True}),
    ("glm-4-9b-chat-hf", {"num_hidden_layers": 2, "attention_bias": False, "head_dim": 64}),
    ("glm-4-32b-0414", {"num_hidden_layers": 2, "attention_bias": True}),
    ("glm-4.5-air", {"num_hidden_layers": 3, "first_k_dense_replace": 2, "use_qk_norm": True,
                     "n_shared_experts": 2}),
    ("starcoder2-3b", {"num_hidden_layers": 2, "use_bias": False, "tie_word_embeddings": False}),
    ("gpt_bigcode-santacoder", {"n_layer": 2, "multi_query": False, "n_inner": 4000}),
    ("granite-3.0-3b-a800m-base", {"num_hidden_layers": 2, "attention_bias": True, "num_local_experts": 8}),
    ("granite-3.0-3b-a800m-base", {"num_hidden_layers": 2, "model_type": "granitemoeshared",
                                   "shared_intermediate_size": 1024}),
    ("minitron-8b-base", {"num_hidden_layers": 2, "attention_bias": True, "mlp_bias": True, "head_dim": 64}),
    ("c4ai-command-r-v01", {"num_hidden_layers": 2, "attention_bias": True, "tie_word_embeddings": False}),
    ("c4ai-command-r7b-12-2024", {"num_hidden_layers": 8, "num_key_value_heads": 4}),
    ("phi-2", {"num_hidden_layers": 2, "qk_layernorm": True, "num_key_value_heads": 8, "tie_word_embeddings": True}),
    ("minimax-m2", {"num_hidden_layers": 2, "attn_type_list": [1, 1], "num_local_experts": 16, "rotary_dim": 32}),
    ("llama-4-maverick-text", {"num_hidden_layers": 4, "num_local_experts": 4, "use_qk_norm": True}),
    ("llama-4-maverick-text", {"num_hidden_layers": 6, "num_local_experts": 4, "interleave_moe_layer_step": 1,
                               "no_rope_layer_interval": 3}),
    ("llama-4-maverick-text", {"num_hidden_layers": 4, "num_local_experts": 4, "moe_layers": [2, 3]}),
    ("kimi-k2", {"num_hidden_layers": 3, "n_routed_experts": 16, "first_k_dense_replace": 1}),
    ("seed-oss-36b", {"num_hidden_layers": 2, "attention_out_bias": True, "mlp_bias": True}),
    ("ernie-4.5-0.3b", {"num_hidden_layers": 2, "use_bias": True, "tie_word_embeddings": False}),
    # AFM-4.5B's shape as far as published (36 layers, 20 heads, 4 key/value heads, squared ReLU)
    ("llama-3.2-1b", {"model_type": "arcee", "hidden_act": "relu2", "num_hidden_layers": 2, "hidden_size": 2560,
                      "num_attention_heads": 20, "num_key_value_heads": 4, "attention_bias": True}),
    # EXAONE 4.0: norms after each branch, per-head query/key norms, 3 sliding layers to 1 global
    ("llama-3.2-1b", {"model_type": "exaone4", "num_hidden_layers": 4, "sliding_window": 4096,
                      "sliding_window_pattern": 4, "rope_scaling": None}),
    ("llama-3.2-1b", {"model_type": "exaone4", "num_hidden_layers": 2, "sliding_window": None, "rope_scaling": None,
                      "layer_types": ["full_attention"] * 2}),
    # Granite 4.0's hybrid family with attention in every layer and no routed experts (Granite 4.0 micro):
    # each layer's MLP is its shared MLP
    # dots.llm1: GLM-4.5's experts (sigmoid routing, shared experts, the first layers dense) under Qwen3's
    # attention with per-head query/key norms, from GLM-4.5-Air's shape without its GLM-only keys
    ("glm-4.5-air", {"model_type": "dots1", "use_qk_norm": DROP, "partial_rotary_factor": DROP,
                     "num_nextn_predict_layers": DROP, "num_hidden_layers": 3, "n_routed_experts": 16,
                     "first_k_dense_replace": 1}),
    ("glm-4.5-air", {"model_type": "dots1", "use_qk_norm": DROP, "partial_rotary_factor": DROP,
                     "num_nextn_predict_layers": DROP, "num_hidden_layers": 2, "n_routed_experts": 8,
                     "attention_bias": True, "n_shared_experts": 2, "max_window_layers": 2}),
    # GLM-4.7-Flash: DeepSeek-V3's latent attention and experts, its dense layers named by mlp_layer_types
    ("deepseek-v3", {"model_type": "glm4_moe_lite", "num_hidden_layers": 4, "n_routed_experts": 16,
                     "first_k_dense_replace": DROP, "mlp_layer_types": ["dense", "dense", "sparse", "sparse"]}),
    # Ministral 3: Mistral's layers, YaRN positions and every layer's queries scaled with the position
    ("mistral-7b-v0.1", {"model_type": "ministral3", "num_hidden_layers": 2, "head_dim": 128, "rope_theta": DROP,
                         "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0,
                                             "original_max_position_embeddings": 16384, "beta_fast": 32.0,
                                             "beta_slow": 1.0, "llama_4_scaling_beta": 0.1}}),
    ("granite-3.1-8b-instruct", {"model_type": "granitemoehybrid", "num_hidden_layers": 2,
                                 "layer_types": ["attention"] * 2, "num_local_experts": 0,
                                 "shared_intermediate_size": 6400, "position_embedding_type": "rope"}),
]


@pytest.mark.parametrize("name, left_out", [
    ("mistral-7b-v0.1", ("num_key_value_heads",)), ("mixtral-8x7b", ("num_key_value_heads",)),
    ("starcoder2-3b", ("num_key_value_heads",)), ("smollm3-3b", ("num_key_value_heads",)),
    ("qwen3-30b-a3b", ("num_key_value_heads",)), ("seed-oss-36b", ("num_key_value_heads",)),
    ("gemma-2-9b", ("num_attention_heads", "num_key_value_heads")),
    ("llama-3.2-1b", ("num_key_value_heads",)),  # LlamaConfig's None: one key/value head a head
])
def test_left_out_heads_take_the_config_class_defaults(name, left_out):
    """A config without its head counts takes its config class's defaults, as transformers builds it
    (a Mistral config without num_key_value_heads has 8, not one a head)."""
    data = {key: value for key, value in config(name).items() if key not in left_out}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DsautoWarning)
        assert model_from_hf_config(data, name).num_parameters() == transformers_count(data)


@pytest.mark.parametrize("name, changes", VARIANTS)
def test_variant_counts_match_transformers(name, changes):
    data = {key: value for key, value in {**config(name), **changes}.items() if value is not DROP}
    assert model_from_hf_config(data, name).num_parameters() == transformers_count(data)


# --- the fields read -------------------------------------------------------------------------------


def test_mistral_nemo_head_dim():
    model = load("mistral-nemo-12b")
    assert model.head_dim == model.attention_head_dim == 128  # not 5120 / 32 = 160
    assert model.num_parameters() == 12_247_782_400  # 12.2B, not 12.8B


def test_llama31_rope():
    model = load("llama-3.1-8b")
    assert (model.rotary_base, model.rope_scaling, model.rope_scaling_factor) == (500000.0, "llama3", 8.0)
    assert dict(model.rope_scaling_params) == {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 8192.0}
    assert load("llama-3.2-1b").tied_embeddings


def test_qwen_biases_and_norms():
    qwen2 = load("qwen2.5-7b")
    assert qwen2.biases == (True, False, False) and qwen2.norm_epsilon == 1e-6
    qwen3 = load("qwen3-8b")
    assert qwen3.qk_norm and qwen3.biases == (False, False, False) and qwen3.head_dim == 128


def test_gemma_families():
    gemma = load("gemma-7b")
    assert (gemma.mlp, gemma.gelu_tanh, gemma.head_dim, gemma.tied_embeddings) == ("geglu", True, 256, True)
    assert gemma.norm_plus_one and gemma.embedding_scale and gemma.norms_per_layer == 2
    gemma2 = load("gemma-2-27b")
    assert (gemma2.attention_softcap, gemma2.final_logit_softcap) == (50.0, 30.0)
    assert (gemma2.sliding_window, gemma2.global_attention_every, gemma2.norms_per_layer) == (4096, 2, 4)
    assert gemma2.attention_scale_dim == 144  # query_pre_attn_scalar, not the head width 128
    gemma3 = load("gemma-3-1b")
    assert (gemma3.sliding_window, gemma3.global_attention_every, gemma3.qk_norm) == (512, 6, True)
    assert (gemma3.rotary_base, gemma3.rotary_base_local) == (1e6, 1e4)
    assert gemma3.sliding_layers() == 22  # 26 layers, every 6th global


def test_sliding_window_prices_the_attention_it_computes():
    from dsauto.spec.model import layer_groups

    gemma3 = load("gemma-3-1b")
    block = layer_groups(gemma3, seq_len=4096, dtype_bytes=2)[1]
    # Local layers attend to 512 of (on average) 2048 causal keys; 22 of 26 layers are local.
    local = (512 * 513 / 2 + (4096 - 512) * 512) / (4096 * 4097 / 2)
    assert block.attention_window_fraction == pytest.approx((22 * local + 4) / 26)
    assert layer_groups(gemma3, seq_len=512, dtype_bytes=2)[1].attention_window_fraction == 1.0
    mistral = load("mistral-7b-v0.1")  # every layer slides (4096) from 8192 tokens on
    assert layer_groups(mistral, seq_len=8192, dtype_bytes=2)[1].attention_window_fraction < 0.75


def test_a_quantized_checkpoint_is_named_for_every_family():
    # Kimi K2 (a DeepSeek-V3 mixture of experts) and a dense Llama stored in fp8 and AWQ
    with pytest.warns(DsautoWarning, match=r"stored in fp8 \(quantization_config\); dsauto plans training in the"):
        model_from_hf_config(config("kimi-k2"), "kimi-k2")
    awq = {**config("llama-3.1-8b"), "quantization_config": {"quant_method": "awq", "bits": 4}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model_from_hf_config(awq, "llama-awq")
    assert [str(w.message) for w in caught] == [
        "llama-awq: its checkpoint is stored in awq (quantization_config); dsauto plans training in the plan's "
        "dtype, the weights loaded at that precision, not awq training or quantization-aware fine-tuning."]


def test_a_window_as_long_as_the_sequence_is_full_attention():
    """Phi-3.5-mini's config gives a 262,144-token window over 131,072 positions: it slides over no
    sequence it trains on, so its plans run and price full attention (Megatron-core's ring of context
    parallelism, which refuses windows, included), while a shorter window slides."""
    from dsauto.api import make_plan
    from dsauto.emit.megatron import megatron_args

    data = {**config("phi-3-mini-4k"), "sliding_window": 262144, "max_position_embeddings": 131072}
    data.pop("rope_scaling", None)
    phi = model_from_hf_config(data, "phi-3.5-mini")
    assert phi.sliding_window == 262144 and not phi.window_slides(131072) and phi.window_slides(None)
    plan = make_plan(phi, "h100-80gb", nodes=4, global_batch=32, seq_len=131072, engine="megatron", cp=8,
                     cp_comm_type="p2p")
    assert plan.cp == 8 and not any(line.startswith("--window-size") for line in megatron_args(plan))
    short = model_from_hf_config({**data, "sliding_window": 2047}, "phi-3.5-mini")
    assert short.window_slides(4096) and not short.window_slides(2047)
    with pytest.raises(DsautoError, match="does not run sliding-window attention"):
        make_plan(short, "h100-80gb", nodes=4, global_batch=32, seq_len=131072, engine="megatron", cp=8,
                  cp_comm_type="p2p")


def test_phi3_falcon_bloom_neox_opt_bert():
    assert load("phi-3-mini-4k").sliding_window == 2047
    falcon7 = load("falcon-7b")
    assert (falcon7.kv_heads, falcon7.parallel_attention, falcon7.norms_per_layer) == (1, True, 1)
    falcon40 = load("falcon-40b")
    assert (falcon40.kv_heads, falcon40.norms_per_layer) == (8, 2)
    bloom = load("bloom-560m")
    assert bloom.position_embedding == "alibi" and bloom.embedding_norm and bloom.max_position_embeddings == 2048
    neox = load("pythia-1b")
    assert neox.rotary_percent == 0.25 and neox.parallel_attention and not neox.tied_embeddings
    opt = load("opt-1.3b")
    assert (opt.mlp, opt.position_offset, opt.max_position_embeddings) == ("relu", 2, 2048)
    bert, roberta = load("bert-base-uncased"), load("roberta-base")
    assert bert.architecture == roberta.architecture == "encoder"
    assert (bert.norm_position, bert.norm_epsilon, bert.type_vocab_size) == ("post", 1e-12, 2)
    assert (roberta.max_position_embeddings, roberta.position_offset, roberta.type_vocab_size) == (512, 2, 1)


def test_granite_multipliers():
    granite = load("granite-3.1-8b-instruct")
    assert (granite.embedding_multiplier, granite.residual_multiplier, granite.logit_scale) == (12.0, 0.22, 1 / 16)
    assert granite.attention_scale_dim == 16384  # scores scaled by 1/128, not 1/sqrt(128)
    moe = load("granite-3.0-3b-a800m-base")
    assert (moe.num_experts, moe.moe_top_k, moe.expert_ffn_hidden_size, moe.shared_expert_ffn_hidden_size) == (40, 8, 512, 0)


def test_olmo_norms_after_each_branch():
    olmo2, olmo3 = load("olmo2-1124-7b"), load("olmo3-1025-7b")
    assert (olmo2.norm_position, olmo2.qk_norm, olmo2.qk_norm_full_width, olmo2.sliding_window) == ("output", True, True, 0)
    assert (olmo3.sliding_window, olmo3.global_attention_every, olmo3.rope_scaling) == (4096, 4, "yarn")
    assert not olmo3.rope_scaling_local  # Olmo3Config puts rope_scaling in full_attention's parameters
    gemma3 = model_from_hf_config({**config("gemma-3-1b"), "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
                                  "gemma-3")
    assert (gemma3.rope_scaling, gemma3.rope_scaling_local) == ("linear", False)
    assert load("gpt-oss-20b").rope_scaling_local  # one rotary embedding for every layer


def test_glm_smollm3_starcoder2_bigcode_nemotron():
    glm, glm4 = load("glm-4-9b-chat-hf"), load("glm-4-32b-0414")
    assert (glm.rotary_percent, glm.biases, glm.norms_per_layer) == (0.5, (True, False, False), 2)
    assert (glm4.norms_per_layer, glm4.biases) == (4, (False, False, False))  # the 32B has no QKV bias
    air = load("glm-4.5-air")
    assert (air.num_experts, air.moe_top_k, air.shared_expert_ffn_hidden_size, air.moe_first_dense_layers) == (128, 8, 1408, 1)
    assert (air.moe_router, air.head_dim, air.hidden_size, air.qkv_bias) == ("sigmoid", 128, 4096, True)
    smol = load("smollm3-3b")
    assert (smol.no_rope_every, smol.sliding_window, smol.tied_embeddings) == (4, 0, True)
    star = load("starcoder2-3b")
    assert (star.mlp, star.gelu_tanh, star.linear_bias, star.sliding_window, star.kv_heads) == ("gelu", True, True, 4096, 2)
    santa = load("gpt_bigcode-santacoder")
    assert (santa.kv_heads, santa.position_embedding, santa.ffn_hidden_size) == (1, "learned", 4 * 2048)
    nemotron = load("minitron-8b-base")
    assert (nemotron.mlp, nemotron.norm, nemotron.norm_plus_one, nemotron.rotary_percent) == ("relu2", "layernorm", True, 0.5)


def test_llama4_text():
    maverick = load("llama-4-maverick-text")
    assert maverick.moe_layers() == tuple(range(1, 48, 2))  # every second layer, from the second
    assert (maverick.num_experts, maverick.moe_top_k, maverick.expert_ffn_hidden_size, maverick.ffn_hidden_size,
            maverick.shared_expert_ffn_hidden_size) == (128, 1, 8192, 16384, 8192)
    assert (maverick.moe_router, maverick.moe_router_balancing_bias, maverick.moe_probs_on_input) == ("sigmoid", False, True)
    assert (maverick.no_rope_every, maverick.attention_chunk, maverick.qk_l2_norm) == (4, 8192, False)
    scout_like = model_from_hf_config({**config("llama-4-maverick-text"), "interleave_moe_layer_step": 1,
                                       "num_local_experts": 16, "use_qk_norm": True}, "scout")
    assert len(scout_like.moe_layers()) == 48 and scout_like.qk_l2_norm


def test_a_pipeline_stage_computes_its_own_layers_attention_not_the_stacks_average():
    """Gemma 3's every sixth layer attends to the whole sequence and its others within 512 tokens. The
    block group averages them (the whole stack exact); a pipeline stage is priced with its own
    layers' kinds, so moving the global layer 5 onto the first stage costs it more than moving the
    local layer 4 did (before, both cost the average layer)."""
    from dsauto.api import make_plan
    from dsauto.spec.model import layer_group_per_layer, layer_groups, local_attention_layers

    gemma3 = load("gemma-3-1b")
    assert local_attention_layers(gemma3, 8192) == [i for i in range(26) if i not in (5, 11, 17, 23)]
    assert local_attention_layers(gemma3, 512) == []  # the window covers the sequence
    block = layer_groups(gemma3, 8192, 2)[1]
    per_layer = layer_group_per_layer(gemma3, layer_groups(gemma3, 8192, 2), 8192, 2)
    fractions = [g.attention_window_fraction for g in per_layer[1:-1]]
    assert fractions[5] == 1.0 and fractions[4] < 0.13
    assert sum(fractions) == pytest.approx(26 * block.attention_window_fraction)

    def first_stage_forward(layout: str) -> tuple[float, float]:
        plan = make_plan(gemma3, "h100-80gb", nodes=1, gpus_per_node=2, global_batch=8, seq_len=8192,
                         engine="megatron", pp=2, tp=1, vpp=1, stage_layers=layout, offload="none",
                         micro_batch=1, checkpoint=False, attention_kernel="flash")
        return plan.stages[0].forward_seconds, sum(s.forward_seconds for s in plan.stages)

    (four, total4), (five, total5), (six, total6) = map(first_stage_forward, ("4,22", "5,21", "6,20"))
    local_layer, global_layer = five - four, six - five
    assert global_layer > 1.3 * local_layer  # 8,192 causal keys against 512: in FlashAttention a third of it
    assert total4 == pytest.approx(total5, rel=1e-9) and total5 == pytest.approx(total6, rel=1e-9)

    # Llama 4 Maverick: MoE in every second layer, chunked attention in all but every fourth (MoE) one
    maverick = load("llama-4-maverick-text")
    kinds = layer_group_per_layer(maverick, layer_groups(maverick, 32768, 2), 32768, 2)[1:-1]
    assert [g.moe_layer_fraction for g in kinds] == [float(i % 2) for i in range(48)]
    assert [g.attention_window_fraction == 1.0 for g in kinds] == [(i + 1) % 4 == 0 for i in range(48)]


def test_chunked_attention_prices_one_triangle_per_chunk():
    from dsauto.spec.model import attention_window_fraction

    maverick = load("llama-4-maverick-text")
    assert attention_window_fraction(maverick, 8192) == 1.0
    # 32K tokens: 36 of 48 layers attend within four 8K chunks, the 12 without positions to all
    chunked = 4 * 8192 * 8193 / 2 / (32768 * 32769 / 2)
    assert attention_window_fraction(maverick, 32768) == pytest.approx((36 * chunked + 12) / 48)


def test_exaone4_and_arcee():
    base = {**config("llama-3.2-1b"), "model_type": "exaone4", "num_hidden_layers": 8, "rope_scaling": None}
    hybrid = model_from_hf_config({**base, "sliding_window": 4096, "sliding_window_pattern": "LLLG",
                                   "layer_types": None}, "exaone4")
    # three sliding layers to one global one, which attends without rotary positions
    assert (hybrid.sliding_window, hybrid.global_attention_every, hybrid.no_rope_every) == (4096, 4, 4)
    assert (hybrid.norm_position, hybrid.qk_norm, hybrid.qk_norm_full_width) == ("output", True, False)
    plain = model_from_hf_config({**base, "sliding_window": None, "layer_types": ["full_attention"] * 8}, "exaone4")
    assert (plain.sliding_window, plain.no_rope_every) == (0, 0)
    arcee = model_from_hf_config({**config("llama-3.2-1b"), "model_type": "arcee", "hidden_act": "relu2"}, "arcee")
    assert (arcee.mlp, arcee.gated_mlp) == ("relu2", False)
    assert model_from_hf_config(config("kimi-k2"), "kimi-k2").num_experts == 384


def test_minimax_m2():
    m2 = load("minimax-m2")
    assert (m2.num_experts, m2.moe_top_k, m2.expert_ffn_hidden_size, m2.moe_router) == (256, 8, 1536, "sigmoid")
    assert (m2.qk_norm_full_width, m2.rotary_percent, m2.head_dim, m2.rotary_base) == (True, 0.5, 128, 5e6)
    assert len(m2.moe_layers()) == 62


def test_cohere_and_phi():
    r, r7b, phi = load("c4ai-command-r-v01"), load("c4ai-command-r7b-12-2024"), load("phi-2")
    assert (r.norm, r.norm_bias, r.parallel_attention, r.norms_per_layer, r.logit_scale) == ("layernorm", False, True, 1, 0.0625)
    # Command R7B: three sliding layers to one global layer, which attends without rotary positions
    assert (r7b.sliding_window, r7b.global_attention_every, r7b.no_rope_every, r7b.rotary_base) == (4096, 4, 4, 50000.0)
    assert (phi.head_bias, phi.parallel_attention, phi.norms_per_layer, phi.rotary_percent, phi.linear_bias) == (
        True, True, 1, 0.4, True)


def test_new_families_reach_megatron_as_flags_or_named_gaps():
    from dsauto.emit.megatron import _mlp, _positions
    from dsauto.engines.architecture import megatron_gaps

    assert "--squared-relu" in _mlp(load("minitron-8b-base"))
    assert "--no-rope-freq 4" in _positions(load("smollm3-3b"))  # 36 layers, every 4th without positions
    gaps = " ".join(megatron_gaps(load("granite-3.1-8b-instruct")))
    for said in ("embeddings multiplied by 12", "multiplied by 0.22 before their residual adds",
                 "logits multiplied by 0.0625"):
        assert said in gaps
    assert "each branch's output normalised" in " ".join(megatron_gaps(load("olmo2-1124-7b")))
    odd = model_from_hf_config({**config("smollm3-3b"), "num_hidden_layers": 6, "no_rope_layers": None,
                                "layer_types": None}, "smollm3")
    assert odd.no_rope_every == 4 and "--no-rope-freq" not in " ".join(_positions(odd))
    assert "only when it divides the 6 layers" in " ".join(megatron_gaps(odd))


def test_gpt2_config_reads_the_tanh_gelu():
    model = load("gpt2")
    assert (model.mlp, model.gelu_tanh, model.dropout, model.ffn_hidden_size) == ("gelu", True, True, 3072)


# --- refused with one sentence ---------------------------------------------------------------------


def test_moe_fields_read():
    mixtral = load("mixtral-8x7b")
    assert (mixtral.num_experts, mixtral.moe_top_k, mixtral.expert_ffn_hidden_size) == (8, 2, 14336)
    assert len(mixtral.moe_layers()) == 32
    v3 = load("deepseek-v3")
    assert (v3.num_experts, v3.moe_top_k, v3.moe_ffn_hidden_size, v3.shared_expert_ffn_hidden_size) == (256, 8, 2048, 2048)
    assert (v3.moe_first_dense_layers, v3.moe_router, len(v3.moe_layers())) == (3, "sigmoid", 58)
    assert (v3.q_lora_rank, v3.kv_lora_rank, v3.qk_nope_head_dim, v3.qk_rope_head_dim, v3.v_head_dim) == (
        1536, 512, 128, 64, 128)
    assert load("deepseek-v2-lite").q_lora_rank == 0  # null: one query projection
    qwen2 = load("qwen1.5-moe-a2.7b")
    assert (qwen2.shared_expert_ffn_hidden_size, qwen2.shared_expert_gate, qwen2.qkv_bias) == (5632, True, True)
    oss = load("gpt-oss-20b")
    assert oss.attention_sinks and oss.moe_router_bias and oss.moe_expert_bias and oss.global_attention_every == 2
    assert load("olmoe-1b-7b").qk_norm_full_width


def test_moe_block_group_averages_dense_and_moe_layers():
    from dsauto.spec.model import block_parameters, layer_groups

    v3 = load("deepseek-v3")
    block = layer_groups(v3, seq_len=4096, dtype_bytes=2, pad_vocab=False)[1]
    parts = block_parameters(v3)
    assert block.moe_layer_fraction == pytest.approx(58 / 61)
    assert block.expert_params == pytest.approx(58 / 61 * 256 * parts.expert)
    assert block.params * 61 == pytest.approx(parts.total(58, 61), abs=61)  # rounded per layer
    assert block.expert_gemm_dim == 2048 and block.dispatch_bytes_per_token == pytest.approx(58 / 61 * 8 * 7168 * 2)
    # FLOPs are the active ones: 8 routed experts of 2048 and one shared, not 256
    assert block.expert_matmul_flops_per_token == pytest.approx(2 * 58 / 61 * 8 * 3 * 7168 * 2048)


@pytest.mark.parametrize("name, changes, pattern", [
    ("qwen3-30b-a3b", {"decoder_sparse_step": 2}, r"decoder_sparse_step=2"),
    ("qwen3-30b-a3b", {"mlp_only_layers": [3, 7]}, r"mlp_only_layers"),
    ("deepseek-v3", {"scoring_func": "tanh"}, r"scoring_func"),
    ("deepseek-v3", {"attention_bias": True}, r"attention_bias=True"),
    ("olmoe-1b-7b", {"clip_qkv": 8.0}, r"clip_qkv=8.0"),
    ("deepseek-v2-lite", {"num_experts_per_tok": None}, r"experts per token"),  # no class default
    ("gpt-oss-20b", {"experts_per_token": 2}, r"experts per token once"),
])
def test_moe_value_dsauto_does_not_model_is_refused(name, changes, pattern):
    with pytest.raises(DsautoError, match=pattern):
        model_from_hf_config({**config(name), **changes}, name)


def test_unknown_key_of_a_mixture_of_experts_is_an_error_naming_it():
    with pytest.raises(DsautoError, match=r"does not know the mixtral config key\(s\) expert_layer_period, "
                                          r"which may change the experts"):
        model_from_hf_config({**config("mixtral-8x7b"), "expert_layer_period": 2}, "config.json")


@pytest.mark.parametrize("model_type, keys", [
    ("dbrx", {}),  # a family dsauto does not read as a mixture
    ("dbrx", {"num_experts": 16}),
    ("llama", {"num_local_experts": 4}),  # MoE keys in a dense family's config are never read as dense
])
def test_other_moe_families_are_refused_naming_their_fields(model_type, keys):
    data = {**config("llama-3.2-1b"), "model_type": model_type, **keys}
    with pytest.raises(DsautoError, match=r"is a mixture of experts .*which dsauto reads only for model_type "
                                          r"deepseek_v2, deepseek_v3, dots1, ernie4_5_moe, glm4_moe, glm4_moe_lite, gpt_oss, granitemoe, granitemoeshared, kimi_k2, "
                                          r"llama4_text, minimax_m2, mixtral, olmoe, qwen2_moe, qwen3_moe\.$") as error:
        model_from_hf_config(data, "config.json")
    for key in keys:
        assert key in str(error.value)


@pytest.mark.parametrize("model_type, what", [("qwen3_next", "Gated DeltaNet"), ("qwen3_5_moe_text", "Gated DeltaNet"),
                                              ("nemotron_h", "Mamba"), ("jamba", "Mamba"), ("deepseek_v32", "Sparse"),
                                              ("kimi_linear", "Kimi Delta Attention"), ("granitemoehybrid", "Mamba")])
def test_models_with_layers_other_than_attention_are_refused_naming_them(model_type, what):
    data = {**config("llama-3.2-1b"), "model_type": model_type, "num_experts": 16}
    with pytest.raises(DsautoError, match=rf"is a {model_type} model with .*{what}.*which dsauto does not price"):
        model_from_hf_config(data, "config.json")


def test_mlp_layer_types_read_as_the_first_dense_layers_or_refused():
    data = {**config("deepseek-v3"), "model_type": "glm4_moe_lite", "num_hidden_layers": 4}
    data.pop("first_k_dense_replace")
    model = model_from_hf_config({**data, "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]}, "config.json")
    assert model.moe_layers() == (1, 2, 3)
    assert model_from_hf_config(data, "config.json").moe_layers() == (1, 2, 3)  # Glm4MoeLiteConfig's default
    with pytest.raises(DsautoError, match=r"MLP layer types .* other than dense layers first"):
        model_from_hf_config({**data, "mlp_layer_types": ["dense", "sparse", "dense", "sparse"]}, "config.json")


def test_ministral3_queries_scaled_with_the_position_are_named_not_read_as_yarn():
    data = {**config("mistral-7b-v0.1"), "model_type": "ministral3",
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0,
                                "original_max_position_embeddings": 16384, "llama_4_scaling_beta": 0.1}}
    data.pop("rope_theta")
    model = model_from_hf_config(data, "config.json")
    assert model.rope_scaling == "yarn" and "llama_4_scaling_beta" not in dict(model.rope_scaling_params)
    assert any("llama_4_scaling_beta" in clause for clause in model.unmodelled)


def test_ernie_moe_layers_experts_and_router_read_as_transformers_builds_them():
    """ERNIE 4.5's MoE layers run from moe_layer_start_index every moe_layer_interval ((i + 1) % interval:
    Ernie4_5_MoeDecoderLayer), its shared experts are moe_num_shared_experts of the expert width, and its
    softmax router's correction bias is named as what Megatron-core does not build."""
    model = load("ernie-4.5-21b-a3b")
    assert model.moe_layers() == tuple(range(1, 28)) and model.shared_expert_ffn_hidden_size == 2 * 1536
    assert any("correction bias" in clause for clause in model.unmodelled)
    spaced = model_from_hf_config({**config("ernie-4.5-21b-a3b"), "num_hidden_layers": 6, "moe_layer_interval": 2,
                                   "moe_layer_end_index": -1,
                                   "moe_layer_start_index": 2}, "config.json")
    assert spaced.moe_layers() == (3, 5)  # layers 3 and 5: (i + 1) % 2 == 0 from layer 2
    with pytest.raises(DsautoError, match=r"dense layers after the last MoE layer \(moe_layer_end_index=20 of 28"):
        model_from_hf_config({**config("ernie-4.5-21b-a3b"), "moe_layer_end_index": 20}, "config.json")


def test_granite_hybrids_are_read_where_every_layer_is_attention():
    """Granite 4.0's hybrid family plans where its layer_types are all attention (Granite 4.0 micro), as
    Granite with its shared MLP; one Mamba layer, routed experts or NoPE attention are refused."""
    base = {**config("granite-3.1-8b-instruct"), "model_type": "granitemoehybrid", "num_hidden_layers": 2,
            "layer_types": ["attention"] * 2, "num_local_experts": 0, "shared_intermediate_size": 6400,
            "position_embedding_type": "rope"}
    base.pop("mlp_bias")
    assert model_from_hf_config(base, "config.json").ffn_hidden_size == 6400
    for changes, message in (({"layer_types": ["mamba", "attention"]}, "with Mamba state-space layers"),
                             ({"num_local_experts": 8, "num_experts_per_tok": 2}, "is a mixture of experts"),
                             ({"position_embedding_type": "nope"}, "attention without position embeddings")):
        with pytest.raises(DsautoError, match=message):
            model_from_hf_config({**base, **changes}, "config.json")


def test_t5_is_refused_saying_what_is_supported():
    with pytest.raises(DsautoError, match=r"encoder-decoder model \(model_type 't5'\); encoder-decoder models "
                                          r"\(t5, bart, \.\.\.\) are not supported yet: dsauto plans decoder-only "
                                          r"\(causal LM\) and encoder-only \(masked LM\) stacks\.$"):
        model_from_hf_config(config("t5-base"), "t5-base")


def test_multimodal_config_is_refused():
    data = {"model_type": "gemma3", "text_config": config("gemma-3-1b"), "vision_config": {"hidden_size": 1152}}
    with pytest.raises(DsautoError, match=r"multimodal model .* text_config, vision_config.*give the text "
                                          r"model's config \(its text_config\)"):
        model_from_hf_config(data, "config.json")
    # Llama 4's multimodal config is said to be multimodal, not an unread mixture of experts
    llama4 = {"model_type": "llama4", "text_config": config("llama-4-maverick-text"), "vision_config": {}}
    llama4["vision_config"] = {"hidden_size": 1408}
    with pytest.raises(DsautoError, match=r"is a multimodal model \(model_type 'llama4' with text_config"):
        model_from_hf_config(llama4, "config.json")
    # Qwen2.5-VL keeps its language model's keys at the top level: no text_config to point at
    with pytest.raises(DsautoError, match=r"give the text model's config \(its language model's keys, with"):
        model_from_hf_config({**config("qwen2.5-7b"), "model_type": "qwen2_5_vl", "vision_config": {"depth": 32}},
                             "config.json")


def test_a_text_config_takes_its_class_defaults():
    """Gemma 3's text_config inside the multimodal config.json leaves out what Gemma3TextConfig
    fills in (the vocabulary, the positions); Llama 4's gives no_rope_layers as an empty list,
    its config class's default (every 4th layer without rotary positions)."""
    gemma = config("gemma-3-1b")
    sparse = {k: v for k, v in gemma.items() if k not in ("vocab_size", "max_position_embeddings")}
    model = model_from_hf_config(sparse, "text_config")
    assert (model.vocab_size, model.max_position_embeddings) == (262_208, 131_072)
    maverick = config("llama-4-maverick-text")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DsautoWarning)
        assert model_from_hf_config({**maverick, "no_rope_layers": []}, "m").no_rope_every == 4


@pytest.mark.parametrize("name, changes, pattern", [
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, r"attention scaled by the layer index \(scale_attn_by_inverse_layer_idx=True\)"),
    ("opt-1.3b", {"word_embed_proj_dim": 512}, r"word_embed_proj_dim 512 unlike hidden_size 2048"),
    ("opt-1.3b", {"layerdrop": 0.1}, r"layerdrop=0.1"),
    ("bert-base-uncased", {"position_embedding_type": "relative_key"}, r"position_embedding_type 'relative_key'"),
    ("llama-3.1-8b", {"rope_scaling": {"rope_type": "fancy", "factor": 2.0}}, r"rope scaling 'fancy'"),
    ("qwen2.5-7b", {"use_sliding_window": True, "max_window_layers": 10, "sliding_window": 4096},
     r"sliding-window layers \(S\) in a pattern other than all of them or all but every N-th \(layer_types F{10}S{18}\)"),
    ("qwen2.5-7b", {"use_mrope": True}, r"multimodal rotary positions"),
    ("llama-3.1-8b", {"hidden_act": "tanh"}, r"hidden_act 'tanh' is not an activation dsauto knows"),
    ("smollm3-3b", {"no_rope_layers": [0] + [1] * 35}, r"not every N-th \(no_rope_layers"),
    ("smollm3-3b", {"use_sliding_window": True, "sliding_window": 4096}, r"sliding-window attention in its layers"),
    ("starcoder2-3b", {"mlp_type": "gated"}, r"another MLP \(mlp_type='gated'\)"),
    ("gpt_bigcode-santacoder", {"num_key_value_heads": 4}, r"num_key_value_heads 4 disagrees with multi_query"),
    ("minitron-8b-base", {"kv_channels": 64}, r"kv_channels 64, which transformers ignores"),
    ("granite-3.1-8b-instruct", {"logits_scaling": 0}, r"logits_scaling must be above 0"),
    ("c4ai-command-r-v01", {"use_qk_norm": True}, r"LayerNorms with a weight per head \(use_qk_norm\)"),
    ("c4ai-command-r7b-12-2024", {"head_dim": 64}, r"head_dim 64, which Cohere2Config replaces"),
    ("c4ai-command-r7b-12-2024", {"use_parallel_block": False}, r"one after the other"),
    ("minimax-m2", {"attn_type_list": [0] + [1] * 61}, r"layers other than full attention"),
    ("minimax-m2", {"qk_norm_type": "per_head"}, r"query/key norms per head \(qk_norm_type='per_head'\)"),
    ("minimax-m2", {"shared_intermediate_size": 512}, r"a shared expert"),
    ("llama-4-maverick-text", {"moe_layers": [1, 2, 5]}, r"MoE layers \[1, 2, 5\] that are not every N-th"),
    ("llama-4-maverick-text", {"layer_types": ["full_attention"] * 48}, r"layer_types .* other than chunked"),
])
def test_architecture_dsauto_does_not_model_is_refused(name, changes, pattern):
    with pytest.raises(DsautoError, match=pattern):
        model_from_hf_config({**config(name), **changes}, name)


def test_unknown_key_is_named_in_a_warning():
    data = {**config("llama-3.1-8b"), "attention_sinks": 4}
    with pytest.warns(DsautoWarning, match=r"does not know the llama config key\(s\) attention_sinks"):
        model = model_from_hf_config(data, "config.json")
    assert model == load("llama-3.1-8b")


def test_config_json_path_loads(tmp_path):
    folder = tmp_path / "Mistral-Nemo"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config("mistral-nemo-12b")))
    assert load_model(str(folder)).num_parameters() == 12_247_782_400


@pytest.mark.parametrize("change, message", [
    ({"num_attention_heads": 30}, "hidden_size (4096) is not divisible by num_attention_heads (30); give head_dim"),
    ({"num_key_value_heads": 5}, "num_attention_heads (32) is not divisible by num_key_value_heads (5)"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be positive, got 0"),
])
def test_an_invalid_config_is_told_in_its_own_keys(change, message):
    """A value the model cannot take is named by the config's key, not dsauto's field name."""
    with pytest.raises(DsautoError) as error:
        model_from_hf_config({**config("llama-3.1-8b"), **change}, "llama")
    assert message in str(error.value) and "num_kv_heads" not in str(error.value)


def test_an_invalid_mixture_of_experts_is_told_in_its_own_keys():
    with pytest.raises(DsautoError, match=r"num_experts_per_tok must be between 1 and num_local_experts \(8\), got 10"):
        model_from_hf_config({**config("mixtral-8x7b"), "num_experts_per_tok": 10}, "mixtral")


@pytest.mark.parametrize("kind", ["su", "yarn"])
def test_phi3s_older_rope_types_read_as_longrope(kind):
    """transformers' Phi3Config rewrites rope_scaling type 'su' and 'yarn' to longrope (per-dimension
    short and long factors, no single factor), so dsauto reads them so too, not as YaRN."""
    data = {**config("phi-3-mini-4k"), "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
            "rope_scaling": {"type": kind, "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}}
    model = model_from_hf_config(data, "phi-3-mini-128k")
    assert (model.rope_scaling, model.rope_scaling_factor) == ("longrope", 1.0)
