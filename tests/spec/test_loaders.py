"""Loading models, hardware and clusters from presets, dsauto YAML and Hugging Face config.json."""

import dataclasses
import json
import warnings

import pytest
import yaml

from dsauto.errors import DsautoError, DsautoWarning
from dsauto.serde import to_dict
from dsauto.spec.loaders import load_cluster, load_hardware, load_model
from dsauto.spec.presets import list_hardware_presets, list_model_presets

LLAMA3_8B_CONFIG = {  # config.json of meta-llama/Meta-Llama-3-8B, trimmed to what matters
    "_name_or_path": "meta-llama/Meta-Llama-3-8B",
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}

GPT2_XL_CONFIG = {  # config.json of openai-community/gpt2-xl, trimmed
    "architectures": ["GPT2LMHeadModel"],
    "model_type": "gpt2",
    "activation_function": "gelu_new",
    "attn_pdrop": 0.1,
    "embd_pdrop": 0.1,
    "resid_pdrop": 0.1,
    "n_ctx": 1024,
    "n_embd": 1600,
    "n_head": 25,
    "n_inner": None,
    "n_layer": 48,
    "n_positions": 1024,
    "vocab_size": 50257,
}

BERT_LARGE_CONFIG = {  # config.json of google-bert/bert-large-uncased, trimmed
    "model_type": "bert",
    "attention_probs_dropout_prob": 0.1,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "max_position_embeddings": 512,
    "num_attention_heads": 16,
    "num_hidden_layers": 24,
    "type_vocab_size": 2,
    "vocab_size": 30522,
}


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def write_json(path, data):
    return write(path, json.dumps(data, indent=2))


# --- Hugging Face config.json ---------------------------------------------------------------


def test_llama_config_loads_like_the_preset(tmp_path):
    path = write_json(tmp_path / "config.json", LLAMA3_8B_CONFIG)
    model = load_model(str(path))
    assert model == dataclasses.replace(load_model("llama3-8b"), name="meta-llama/Meta-Llama-3-8B")


def test_gpt2_config_loads_like_the_preset(tmp_path):
    path = write_json(tmp_path / "gpt2-xl" / "config.json", GPT2_XL_CONFIG)
    model = load_model(str(path))
    assert model == load_model("gpt2-xl")  # n_inner null -> 4 * n_embd; named after its folder


def test_bert_config_loads_like_the_preset(tmp_path):
    path = write_json(tmp_path / "bert-large" / "config.json", BERT_LARGE_CONFIG)
    assert load_model(str(path)) == load_model("bert-large")


def test_model_folder_reads_its_config_json(tmp_path):
    config = {k: v for k, v in LLAMA3_8B_CONFIG.items() if k != "_name_or_path"}
    write_json(tmp_path / "my-llama" / "config.json", config)
    model = load_model(str(tmp_path / "my-llama"))
    assert model.name == "my-llama"
    assert model.num_kv_heads == 8


def test_a_config_file_of_another_name_is_named_after_the_file(tmp_path):
    config = {k: v for k, v in LLAMA3_8B_CONFIG.items() if k != "_name_or_path"}
    path = write_json(tmp_path / "models" / "llama-8b-variant.json", config)
    assert load_model(str(path)).name == "llama-8b-variant"  # not its folder's "models"


def test_llama2_config_without_kv_heads_has_no_gqa(tmp_path):
    config = {**LLAMA3_8B_CONFIG, "intermediate_size": 11008, "vocab_size": 32000}
    del config["num_key_value_heads"]
    model = load_model(str(write_json(tmp_path / "config.json", config)))
    assert model.kv_heads == model.num_attention_heads
    assert model.num_parameters() == load_model("llama2-7b").num_parameters()


@pytest.mark.parametrize("model_type, qkv_bias, position_embedding", [
    ("mistral", False, "rope"),
    ("qwen2", True, "rope"),  # biases on Q, K, V only
])
def test_llama_like_families(tmp_path, model_type, qkv_bias, position_embedding):
    config = {k: v for k, v in LLAMA3_8B_CONFIG.items() if k != "attention_bias"}  # llama's own key
    model = load_model(str(write_json(tmp_path / "config.json", {**config, "model_type": model_type})))
    assert (model.mlp, model.norm, model.position_embedding) == ("swiglu", "rmsnorm", position_embedding)
    assert not model.linear_bias
    assert model.biases == (qkv_bias, False, False)  # QKV, attention output, MLP


def test_llama_config_with_biases(tmp_path):
    config = {**LLAMA3_8B_CONFIG, "attention_bias": True}  # Q, K, V and O; the MLP's are mlp_bias
    assert load_model(str(write_json(tmp_path / "config.json", config))).biases == (True, True, False)
    config["mlp_bias"] = True
    assert load_model(str(write_json(tmp_path / "config.json", config))).linear_bias


def test_gpt_neox_config(tmp_path):
    config = {  # EleutherAI/pythia-1b, trimmed
        "model_type": "gpt_neox", "hidden_size": 2048, "intermediate_size": 8192,
        "max_position_embeddings": 2048, "num_attention_heads": 8, "num_hidden_layers": 16,
        "vocab_size": 50304, "rotary_pct": 0.25, "tie_word_embeddings": False,
    }
    model = load_model(str(write_json(tmp_path / "pythia-1b" / "config.json", config)))
    assert (model.mlp, model.norm, model.position_embedding) == ("gelu", "layernorm", "rope")
    assert model.linear_bias and not model.tied_embeddings and not model.dropout
    assert model.num_parameters() == pytest.approx(1.01e9, rel=0.02)  # pythia-1b: 1,011,781,632


# --- dsauto YAML: round trips and cluster files -------------------------------------------


@pytest.mark.parametrize("name", list_model_presets())
def test_model_yaml_round_trip(tmp_path, name):
    model = load_model(name)
    path = write(tmp_path / "model.yaml", yaml.safe_dump(to_dict(model), sort_keys=False))
    assert load_model(str(path)) == model


@pytest.mark.parametrize("name", list_hardware_presets())
def test_cluster_yaml_round_trip(tmp_path, name):
    cluster = load_cluster(name, nodes=4, gpus_per_node=2, memory_limit="4GiB")
    data = {**to_dict(cluster.hardware), "nodes": 4, "memory_limit_bytes": 4 * 2**30}
    path = write(tmp_path / "cluster.yaml", yaml.safe_dump(data, sort_keys=False))
    assert load_cluster(str(path), gpus_per_node=2) == cluster
    assert load_hardware(str(path)) == cluster.hardware


def test_yaml_reads_exponents_without_a_dot(tmp_path):
    text = (
        "device: {name: gpu, memory_bytes: 16e9, peak_flops: {bf16: 312e12}, memory_bandwidth_gbps: 2e3}\n"
        "intra_node: {bandwidth_gbps: 300, latency_seconds: 5e-6}\n"
        "inter_node: {bandwidth_gbps: 25, latency_seconds: 1E-5}\n"
    )
    hardware = load_hardware(str(write(tmp_path / "my-node.yaml", text)))
    assert hardware.name == "my-node"  # the file name when the file gives none
    assert hardware.device.memory_bytes == 16_000_000_000
    assert hardware.device.peak_flops == {"bf16": 312e12}
    assert hardware.intra_node.latency_seconds == 5e-6 and hardware.inter_node.latency_seconds == 1e-5


def test_cluster_file_values_and_command_line_overrides(tmp_path):
    data = {**to_dict(load_hardware("a100-80gb")), "name": "lab", "gpus_per_node": 4, "nodes": 2,
            "memory_limit_bytes": 70 * 2**30}
    path = str(write(tmp_path / "lab.yaml", yaml.safe_dump(data)))

    cluster = load_cluster(path)
    assert (cluster.nodes, cluster.devices_per_node, cluster.world_size) == (2, 4, 8)
    assert cluster.memory_budget_bytes == 70 * 2**30

    cluster = load_cluster(path, nodes=3, gpus_per_node=8, memory_limit="60GiB")
    assert (cluster.nodes, cluster.devices_per_node, cluster.world_size) == (3, 8, 24)
    assert cluster.memory_budget_bytes == 60 * 2**30


def test_preset_cluster_defaults():
    cluster = load_cluster("h100-80gb")
    assert cluster.world_size == 8
    assert cluster.memory_budget_bytes == 81559 * 2**20 - 3 * 2**30  # nvidia-smi's total less the reserve


def test_model_yaml_may_leave_defaults_and_name_out(tmp_path):
    text = ("architecture: decoder\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 2\n"
            "ffn_hidden_size: 256\nvocab_size: 100\nmax_position_embeddings: 32\n")
    model = load_model(str(write(tmp_path / "toy.yaml", text)))
    assert model.name == "toy" and model.mlp == "gelu"


# --- bad input: one DsautoError sentence naming the file and the problem --------------------

GOOD_MODEL = yaml.safe_dump(to_dict(load_model("gpt-tiny")), sort_keys=False)
GOOD_CLUSTER = yaml.safe_dump(to_dict(load_hardware("cpu")), sort_keys=False)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(DsautoError, match=r"Unknown model preset 'llama9-7b'.*llama2-7b, llama3-405b"):
        load_model("llama9-7b")
    with pytest.raises(DsautoError, match=r"Unknown hardware preset 'a100'.*a100-40gb, a100-80gb"):
        load_cluster("a100")


@pytest.mark.parametrize("load", [load_model, load_hardware, load_cluster])
def test_missing_file(tmp_path, load):
    path = tmp_path / "nope.yaml"
    with pytest.raises(DsautoError, match=rf"file {path} does not exist"):
        load(str(path))


def test_folder_without_a_config_is_not_a_model(tmp_path):
    with pytest.raises(DsautoError, match=rf"{tmp_path} is a folder without a config.json"):
        load_model(str(tmp_path))


def test_a_cluster_file_without_the_fitted_device_fields_is_named(tmp_path):
    data = to_dict(load_hardware("h100-80gb"))
    for key in ("matmul_efficiency", "memory_reserve_bytes"):
        del data["device"][key]
    path = write(tmp_path / "cluster.yaml", yaml.safe_dump(data))
    with pytest.warns(DsautoWarning, match=r"leaves out matmul_efficiency, memory_reserve_bytes, so plans on it "
                                           r"take dsauto's generic matmul_efficiency 0.8, memory_reserve_bytes 0 B"):
        load_cluster(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_cluster("h100-80gb")  # a preset holds them all


def test_folder_is_not_a_cluster_file(tmp_path):
    with pytest.raises(DsautoError, match=rf"{tmp_path} is not a file"):
        load_hardware(str(tmp_path))


# (file name, content, loader, pattern the message must match after the file's path)
BAD_FILES = [
    ("model.yaml", "num_layers: [1\n", load_model, r"is not valid YAML: .* line 2"),
    ("config.json", '{"model_type": "llama",}', load_model, r"is not valid JSON: .* line 1"),
    ("model.yaml", "", load_model, r"must hold a mapping .* holds nothing"),
    ("model.yaml", "- 1\n- 2\n", load_model, r"must hold a mapping .* holds a list"),
    ("model.yaml", GOOD_MODEL + "hiden_size: 5\n", load_model, r"unknown key\(s\) 'hiden_size'"),
    ("model.yaml", GOOD_MODEL + "1: one\nhiden: 2\n", load_model, r"unknown key\(s\) 1, 'hiden'"),
    ("model.yaml", GOOD_MODEL.replace("num_layers: 4", "num_layers: four"), load_model,
     r"num_layers must be a whole number, got 'four'"),
    ("model.yaml", GOOD_MODEL.replace("mlp: gelu", "mlp: tanh"), load_model,
     r"mlp must be one of 'gelu', 'relu', 'relu2', 'swiglu', 'geglu', got 'tanh'"),
    ("model.yaml", GOOD_MODEL.replace("num_attention_heads: 4", "num_attention_heads: 3"), load_model,
     r"is invalid: hidden_size \(128\) is not divisible by num_attention_heads \(3\)"),
    ("model.yaml", GOOD_MODEL.replace("num_layers: 4\n", ""), load_model,
     r"is missing the required key 'num_layers'"),
    ("config.json", json.dumps({"model_type": "xlnet", "d_model": 512}), load_model,
     r"model_type 'xlnet', which dsauto cannot read; use one of model_type arcee, bert, bloom, cohere, cohere2, deepseek_v2, deepseek_v3, dots1, ernie4_5, ernie4_5_moe, exaone4, falcon"),
    ("config.json", json.dumps({"model_type": "t5", "d_model": 512}), load_model,
     r"is an encoder-decoder model \(model_type 't5'\); encoder-decoder models .* are not supported yet"),
    ("config.json", json.dumps({**LLAMA3_8B_CONFIG, "hidden_size": None}), load_model,
     r"has no 'hidden_size'; a Hugging Face llama config must give it"),
    ("config.json", json.dumps({**GPT2_XL_CONFIG, "n_layer": "48"}), load_model,
     r"n_layer must be a whole number, got '48'"),
    ("config.json", json.dumps({**LLAMA3_8B_CONFIG, "tie_word_embeddings": "no"}), load_model,
     r"tie_word_embeddings must be true or false"),
    # the config's own keys, and values transformers would build a broken model from
    ("config.json", json.dumps({**LLAMA3_8B_CONFIG, "rope_theta": -1}), load_model,
     r"is invalid: rope_theta must be a finite number of at least 0, got -1.0"),
    ("config.json", json.dumps({**LLAMA3_8B_CONFIG, "num_key_value_heads": 0}), load_model,
     r"num_key_value_heads must be a positive number of key/value heads, got 0"),
    ("config.json", json.dumps({**LLAMA3_8B_CONFIG, "rope_scaling": {"rope_type": "linear", "factor": 0}}),
     load_model, r"is invalid: rope_scaling.factor must be a finite number above 0, got 0.0"),
    ("cluster.yaml", GOOD_CLUSTER + "node: 2\n", load_cluster,
     r"unknown key\(s\) 'node'; known keys are .*, nodes, memory_limit_bytes"),
    ("cluster.yaml", GOOD_CLUSTER.replace("bandwidth_gbps: 1.5", "bandwidth_gbps: fast"), load_hardware,
     r"intra_node: bandwidth_gbps must be a number, got 'fast'"),
    ("cluster.yaml", GOOD_CLUSTER + "memory_limit_bytes: 9GiB\n", load_cluster,
     r"memory_limit_bytes must be a whole number, got '9GiB'"),
    ("cluster.yaml", GOOD_CLUSTER.replace("  memory_bytes: 8589934592\n", ""), load_cluster,
     r"device is missing the required key 'memory_bytes'"),
]


@pytest.mark.parametrize("file_name, text, load, pattern", BAD_FILES)
def test_bad_file_names_the_file_and_the_problem(tmp_path, file_name, text, load, pattern):
    path = write(tmp_path / file_name, text)
    with pytest.raises(DsautoError, match=pattern) as error:
        load(str(path))
    assert str(path) in str(error.value)


def test_binary_file(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(DsautoError, match=rf"Cannot read {path} \(it is not UTF-8 text\)"):
        load_model(str(path))


def test_memory_limit_beyond_the_device():
    with pytest.raises(DsautoError, match=r"memory limit 90.0 GiB is more than the 80.0 GiB of one A100"):
        load_cluster("a100-80gb", memory_limit="90GiB")
    with pytest.raises(DsautoError, match=r"Cannot read the memory limit 'lots'"):
        load_cluster("a100-80gb", memory_limit="lots")


def test_bad_cluster_override():
    with pytest.raises(DsautoError, match=r"number of nodes must be at least 1, got 0"):
        load_cluster("cpu", nodes=0)


def test_a_config_json_without_its_family_is_named_so(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                                "num_attention_heads": 4, "vocab_size": 256}))
    with pytest.raises(DsautoError) as caught:
        load_model(str(path))
    assert str(caught.value) == (f"{path} reads as a Hugging Face config (num_hidden_layers, intermediate_size) but "
                                 f"has no model_type; add its family's model_type (llama, qwen2, mixtral, ...), as "
                                 f"transformers writes it.")
