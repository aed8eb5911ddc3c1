"""What Hugging Face's modeling code keeps for backward, against the activation count DeepSpeed plans
are priced with (the fused-kernel count of :func:`dsauto.spec.model.layer_groups` plus its unfused
extras, ``LayerGroup.unfused_bytes_per_token``): one decoder layer of each family, built by
transformers from a tiny config on CPU, its saved tensors counted storage by storage as autograd
packs them."""

from __future__ import annotations

import pytest
import torch

from dsauto.spec.hf import model_from_hf_config
from dsauto.spec.model import layer_groups

transformers = pytest.importorskip("transformers")

SEQ, BATCH = 64, 2
BASE = {"hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": SEQ, "head_dim": 32}
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen3": ("Qwen3Config", {}),  # query and key norms of the head width
    "gemma": ("GemmaConfig", {}),  # (1 + weight) in fp32, a gated GeLU
    "olmo2": ("Olmo2Config", {"eos_token_id": 1, "pad_token_id": 1}),  # norms after each branch, query and key norms over all heads
    "gemma3": ("Gemma3TextConfig", {}),  # four norms a layer, query and key norms
    "cohere": ("CohereConfig", {}),  # one LayerNorm in fp32 for parallel attention and MLP
    "olmo3": ("Olmo3Config", {"eos_token_id": 1, "pad_token_id": 1}),  # OLMo 2's norms, sliding windows
    "exaone4": ("Exaone4Config", {}),  # norms after each branch, multiplying the weight after the cast
    # Not here: latent attention (DeepSeek V3), whose unequal query and value head widths torch's CPU
    # attention runs on its fp32 math path, keeping the scores, which a GPU's kernels do not.
}


def layer_saved_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Bytes of the distinct storages the first decoder layer saves for backward in one forward of
    the whole model, but those handed to it from outside (rotary tables, masks) and the weights."""
    layer = model.model.layers[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    outside: set[int] = set()
    saved: dict[int, int] = {}
    inside = [False]

    def enter(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        for value in (*args, *kwargs.values()):
            for tensor in (value if isinstance(value, tuple) else (value,)):
                if isinstance(tensor, torch.Tensor) and tensor is not hidden:
                    outside.add(tensor.untyped_storage().data_ptr())
        inside[0] = True

    def leave(module, args, kwargs, output):
        inside[0] = False

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        ptr = tensor.untyped_storage().data_ptr()
        if inside[0] and ptr not in params and ptr not in outside:
            saved[ptr] = tensor.untyped_storage().nbytes()
        return tensor

    layer.register_forward_pre_hook(enter, with_kwargs=True)
    layer.register_forward_hook(leave, with_kwargs=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=tokens)
    return sum(saved.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_decoder_layer_keeps_what_its_deepspeed_count_prices(family, dtype):
    config_class, extra = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**BASE, **extra}, attention_dropout=0.0)
    config._attn_implementation = "sdpa"
    spec = model_from_hf_config(config.to_dict(), f"tiny {config_class}", f"tiny-{family}")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    tokens = torch.randint(0, BASE["vocab_size"], (BATCH, SEQ))
    measured = layer_saved_bytes(model, tokens)
    block = layer_groups(spec, SEQ, torch.finfo(dtype).bits // 8, tp=1)[1]
    count = BATCH * SEQ * (block.act_tp_bytes_per_token + block.act_replicated_bytes_per_token)
    priced = count + BATCH * SEQ * block.unfused_bytes_per_token
    assert block.unfused_extra_bytes_per_token > 0 and block.unfused_extra_tp_bytes_per_token > 0
    # Up to the per-token statistics (a norm's reciprocal RMS, attention's log-sum-exp), a few percent.
    assert priced == pytest.approx(measured, rel=0.01), (count, priced, measured)
    assert count < 0.9 * measured


@pytest.mark.parametrize("name", ["gelu_new", "gelu_fast"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_python_gelu_keeps_its_intermediate_products(name, dtype):
    # GPT-2's, GPT-J's and Phi's activation: transformers' own, counted beside the input the fused
    # count keeps (the output, which the next matrix keeps, is counted there).
    from transformers.activations import ACT2FN

    from dsauto.spec.model import GELU_FORMULA_WIDTHS

    x = torch.randn(BATCH, SEQ, 352, dtype=dtype, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ACT2FN[name](x)
    beyond_input = sum(saved.values()) - x.untyped_storage().nbytes()
    assert beyond_input == GELU_FORMULA_WIDTHS[name] * x.nbytes
    config = transformers.GPT2Config(n_embd=128, n_head=4, n_inner=352, activation_function=name)
    spec = model_from_hf_config(config.to_dict(), f"GPT2Config with {name}", "tiny-gpt2")
    assert spec.gelu_formula == name
    block = layer_groups(spec, SEQ, x.element_size(), tp=1)[1]
    assert block.unfused_extra_tp_bytes_per_token == GELU_FORMULA_WIDTHS[name] * 352 * x.element_size()


def test_a_deepspeed_plan_says_whose_activations_it_priced():
    from dsauto.api import make_plan
    from dsauto.describe import describe_plan

    def engine_line(model: str, engine: str) -> str:
        plan = make_plan(model, "a100-80gb", nodes=1, engine=engine, global_batch=64, seq_len=512)
        return next(line for line in describe_plan(plan).splitlines() if line.lstrip().startswith("engine"))

    assert ("activations as Hugging Face's modeling code keeps them (fp32 RMSNorms, the gated activation's output)"
            in engine_line("llama2-7b", "deepspeed"))
    assert "the gelu_new GeLU's products" in engine_line("gpt2-xl", "deepspeed")
    assert "Hugging Face" not in engine_line("llama2-7b", "megatron")
    assert "Hugging Face" not in engine_line("bert-large", "deepspeed")  # LayerNorm, exact GeLU: torch's kernels


def test_recomputing_a_hugging_face_mlp_frees_what_it_keeps():
    # The DeepSpeed hook checkpoints LlamaMLP, which then keeps its input alone: the gate's, the up
    # projection's, the SiLU's and the product's outputs are freed, the count's three and the unfused
    # one (LayerGroup.unfused_mlp_extra_bytes_per_token).
    from dsauto.api import make_plan
    from dsauto.profile.memory import MemoryTracker
    from dsauto.runtime.layers import find_layers
    from dsauto.runtime.recompute import apply_selective_recompute

    config = transformers.LlamaConfig(**{**BASE, "num_hidden_layers": 2}, attention_dropout=0.0)
    config._attn_implementation = "sdpa"
    spec = model_from_hf_config(config.to_dict(), "tiny LlamaConfig", "tiny-llama")
    kept = {}
    for modules in (None, "mlp"):
        plan = make_plan(spec, "cpu", nodes=1, gpus_per_node=2, engine="deepspeed", global_batch=2 * BATCH,
                         seq_len=SEQ, dtype="fp32", micro_batch=BATCH, zero_stage=1, checkpoint=False,
                         recompute_modules=modules)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        if modules:
            apply_selective_recompute(plan, find_layers(model))
        tracker = MemoryTracker()
        with tracker:
            logits = model(input_ids=torch.randint(0, BASE["vocab_size"], (BATCH, SEQ))).logits
        kept[modules] = (tracker.final_bytes(), plan.stages[0].activation_bytes)
        del logits
    block = layer_groups(spec, SEQ, 4, tp=1)[1]
    freed = 2 * BATCH * SEQ * (block.mlp_act_bytes_per_token + block.unfused_mlp_extra_bytes_per_token)
    assert block.unfused_mlp_extra_bytes_per_token == BASE["intermediate_size"] * 4  # the SiLU's output
    assert kept[None][0] - kept["mlp"][0] == freed
    assert kept[None][1] - kept["mlp"][1] == freed  # the plans' kept activations


MOE_FAMILIES = {
    "mixtral": ("MixtralConfig", {"num_local_experts": 4}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "moe_intermediate_size": 96, "mlp_only_layers": []}),
    "olmoe": ("OlmoeConfig", {"num_experts": 4, "eos_token_id": 1, "pad_token_id": 1}),
    # shared experts behind a sigmoid gate, whose product keeps their output
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "moe_intermediate_size": 96,
                                     "shared_expert_intermediate_size": 128, "mlp_only_layers": []}),
}


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_a_mixture_of_experts_layer_keeps_what_its_deepspeed_count_prices(family):
    # transformers' grouped experts: each routed copy keeps its input, the gate and up projection's
    # output, the SiLU's, the product and its output (weighted by the router); the count's inner
    # three and two hidden widths, and the SiLU's output (LayerGroup.unfused_expert_extra_bytes_per_token).
    # What is left is the routing's index tensors (int64, a few per copy).
    config_class, extra = MOE_FAMILIES[family]
    config = getattr(transformers, config_class)(**{**BASE, **extra}, num_experts_per_tok=2, attention_dropout=0.0)
    config._attn_implementation = "sdpa"
    spec = model_from_hf_config(config.to_dict(), f"tiny {config_class}", f"tiny-{family}")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    measured = layer_saved_bytes(model, torch.randint(0, BASE["vocab_size"], (BATCH, SEQ)))
    block = layer_groups(spec, SEQ, 2, tp=1)[1]
    count = BATCH * SEQ * (block.act_tp_bytes_per_token + block.act_replicated_bytes_per_token)
    priced = count + BATCH * SEQ * block.unfused_bytes_per_token
    assert block.unfused_expert_extra_bytes_per_token == 2 * spec.expert_ffn_hidden_size * 2
    assert priced == pytest.approx(measured, rel=0.02), (count, priced, measured)
    assert priced <= measured


@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_the_loss_of_soft_capped_logits_keeps_the_tanh_output(softcap):
    # Gemma 2's and 3's final_logit_softcapping: tanh keeps its 16-bit output for backward, beside the
    # fp32 log-softmax, its gradient and the logits' gradient the count prices at the loss.
    import dataclasses

    from dsauto.profile.layers import reference_layer
    from dsauto.profile.memory import MemoryTracker
    from dsauto.spec.loaders import load_model

    model = dataclasses.replace(load_model("gpt-tiny"), name="tiny-capped", norm="rmsnorm", mlp="swiglu",
                                position_embedding="rope", tied_embeddings=False, linear_bias=False,
                                final_logit_softcap=softcap, vocab_size=8192)
    vocab = model.padded_vocab_size(1)
    head = reference_layer(model, "head", 1, vocab).to(torch.bfloat16)
    x = torch.randn(BATCH, SEQ, model.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (BATCH, SEQ))
    tracker = MemoryTracker()
    with tracker:
        head(x, labels).backward()
    counted = layer_groups(model, SEQ, 2, tp=1)[2]
    priced = BATCH * SEQ * (counted.logits_bytes_per_token + counted.act_replicated_bytes_per_token
                            + counted.unfused_extra_bytes_per_token)
    assert priced == pytest.approx(tracker.peak_bytes(), rel=0.02)


def test_the_clamped_gate_of_gpt_oss_keeps_what_the_count_prices():
    # transformers' GptOssExperts._apply_gate and the reference layers' clamped_glu keep the gate and
    # up projection's output, the clamped gate, its sigmoid, the linear half plus one and the product
    # before it, for backward; the output projection keeps the product: 7 inner widths a copy, the
    # count's 3 and 4 more (unfused_expert_extra_bytes_per_token).
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from dsauto.models.moe import clamped_glu

    config = transformers.GptOssConfig(**{**BASE, "num_local_experts": 4, "num_attention_heads": 4},
                                       num_experts_per_tok=2)
    spec = model_from_hf_config(config.to_dict(), "tiny GptOssConfig", "tiny-gpt-oss")
    width = config.intermediate_size
    gate_up = torch.randn(BATCH * SEQ, 2 * width, dtype=torch.bfloat16, requires_grad=True)

    def kept(run) -> int:
        saved: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            product = run()
        return sum(saved.values()) + product.nbytes  # the output projection keeps the product

    theirs = kept(lambda: GptOssExperts(config)._apply_gate(gate_up))
    ours = kept(lambda: clamped_glu(*gate_up.chunk(2, dim=-1), spec.glu_clamp))
    block = layer_groups(spec, SEQ, 2, tp=1)[1]
    per_copy = BATCH * SEQ * 2 * width  # one inner width of the copies, in bf16
    priced = 3 * per_copy + BATCH * SEQ * block.unfused_expert_extra_bytes_per_token / spec.moe_top_k
    assert theirs == ours == priced == 7 * per_copy
