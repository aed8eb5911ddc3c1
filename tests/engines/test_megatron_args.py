"""``--megatron-args``: a Megatron-LM launch read back into the model, the batch and the pins.

The strongest check is the round trip: dsauto's own megatron_args.txt, read back with the model
named, pins everything the plan chose, so the search returns the same plan. The
others check Megatron-LM's defaults for flags a launch leaves out, and each refusal.
"""

from __future__ import annotations

import dataclasses
import shlex
import warnings
from pathlib import Path

import pytest

from dsauto.api import find_plans, make_plan, make_problem
from dsauto.cli import main
from dsauto.emit.megatron import megatron_args, write_megatron_args
from dsauto.engines.megatron_args import expand_layout, parse_megatron_args, read_megatron_args
from dsauto.errors import DsautoError, DsautoWarning
from dsauto.spec.loaders import load_model
from dsauto.units import format_bytes, format_seconds

ROUND_TRIPS = [
    # (model, hardware, nodes, global batch, sequence, pins of the original search)
    ("llama3-8b", "h100-80gb", 4, 512, 8192, {}),  # Megatron-FSDP (ZeRO-2 sharding), fused attention
    ("llama3-70b", "h100-80gb", 8, 512, 8192,
     dict(tp=4, pp=4, vpp=5, stage_layers="even", recompute_num_layers=2)),  # interleaved, block recompute
    ("gpt3-175b", "a100-80gb", 128, 1536, 2048, dict(checkpoint=True)),  # every layer recomputed
    ("llama2-13b", "a100-80gb", 2, 256, 4096,
     dict(tp=2, recompute_modules="core_attn", grad_reduce_in_fp32=False, tp_comm_overlap=True)),
    ("llama3-8b", "h100-80gb", 2, 64, 8192, dict(cp=2, fp8=True, fp8_recipe="tensorwise", checkpoint=False)),
    ("llama2-7b", "a100-40gb", 1, 64, 4096, dict(offload="optimizer", zero_stage=1, checkpoint=True)),
    ("llama3-8b", "h100-80gb", 1, 64, 4096, dict(precision_aware_optimizer="bf16")),  # bf16 moments, ZeRO 1
    ("gpt2-xl", "a100-80gb", 1, 64, 1024, dict(flash_attention=False)),  # unfused, fp32 softmax copy
    ("gpt2-xl", "a100-80gb", 1, 64, 1024, dict(flash_attention=False, attention_softmax_in_fp32=False)),
    ("gpt2-xl", "a100-80gb", 2, 64, 1024, dict(zero_stage=1, overlap_param_gather=False)),  # gathered after the step
    ("gpt2-xl", "a100-80gb", 2, 64, 1024, dict(zero_stage=0, overlap_grad_reduce=False)),  # reduced after backward
]


@pytest.mark.parametrize("name, hardware, nodes, batch, seq, pins", ROUND_TRIPS,
                         ids=[f"{r[0]}-{r[2]}n" for r in ROUND_TRIPS])
def test_dsautos_own_arguments_read_back_into_the_same_plan(tmp_path, name, hardware, nodes, batch, seq, pins):
    plan = make_plan(name, hardware, nodes=nodes, global_batch=batch, seq_len=seq, engine="megatron", **pins)
    path = write_megatron_args(plan, tmp_path / "megatron_args.txt")
    assert "# Not expressed" not in path.read_text()  # the flags say everything the plan chose
    launch = read_megatron_args(path, plan.model)
    assert launch.unknown == []
    assert launch.notes == [] and launch.ddp_bucket_size == megatron_bucket_params(plan)
    [again] = find_plans(make_problem(launch.model, hardware, nodes=nodes, **launch.train, **launch.pins))
    # The same plan; only the ranking's record of the ties differs, the launch having pinned them away.
    assert dataclasses.replace(again, ranking=None) == dataclasses.replace(plan, ranking=None)


CONFIGS = Path(__file__).parents[1] / "spec" / "configs"


@pytest.mark.parametrize("config, flag", [("deepseek-v2-lite.json", "--multi-latent-attention"),
                                          ("gpt-oss-20b.json", "--position-embedding-type yarn")])
def test_a_model_the_flags_cannot_describe_reads_back_with_it_named(tmp_path, config, flag):
    """Latent attention's widths and YaRN's scaling come from no flag dsauto reads: without --model such
    a launch is refused; with it, dsauto's own megatron_args.txt reads back into the same plan, its
    shape flags known, and a note says the flags' model is the named one, unchecked."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DsautoWarning)
        model = load_model(str(CONFIGS / config))
    plan = make_plan(model, "h100-80gb", nodes=1, global_batch=64, seq_len=4096, engine="megatron")
    path = write_megatron_args(plan, tmp_path / "megatron_args.txt")
    with pytest.raises(DsautoError, match="the model with --model"):
        read_megatron_args(path)
    launch = read_megatron_args(path, plan.model)
    assert launch.unknown == []
    assert any(f"sets {flag}" in note and "the model is --model" in note for note in launch.notes), launch.notes
    [again] = find_plans(make_problem(launch.model, "h100-80gb", nodes=1, **launch.train, **launch.pins))
    assert dataclasses.replace(again, ranking=None) == dataclasses.replace(plan, ranking=None)
    # another model named is still refused: by the feature it lacks, or by the shape the flags give
    with pytest.raises(DsautoError, match=f"sets {flag}, and --model llama3-8b has no"):
        read_megatron_args(path, load_model("llama3-8b"))
    with pytest.raises(DsautoError, match="describes a model with num_layers"):
        read_megatron_args(path, dataclasses.replace(plan.model, num_layers=plan.model.num_layers + 1))


def megatron_bucket_params(plan) -> int:
    line = next(line for line in megatron_args(plan) if line.startswith("--ddp-bucket-size "))
    return int(line.split()[1])


def test_the_model_is_read_from_the_flags_given_the_vocabulary():
    plan = make_plan("llama3-8b", "h100-80gb", nodes=1, global_batch=64, seq_len=8192, engine="megatron", tp=2)
    flags = [line for line in megatron_args(plan) if not line.startswith("#")]
    launch = parse_megatron_args(" ".join(flags).split() + ["--vocab-size", "128256"])
    model = launch.model
    assert (model.num_layers, model.hidden_size, model.ffn_hidden_size, model.kv_heads, model.vocab_size) == (
        32, 4096, 14336, 8, 128256)
    assert (model.mlp, model.norm, model.position_embedding, model.tied_embeddings, model.linear_bias,
            model.dropout, model.rotary_base) == ("swiglu", "rmsnorm", "rope", False, False, False, 500000.0)
    [again] = find_plans(make_problem(model, "h100-80gb", nodes=1, **launch.train, **launch.pins))
    assert (again.tp, again.micro_batch, again.zero_stage) == (plan.tp, plan.micro_batch, plan.zero_stage)
    assert again.prediction == plan.prediction  # the same costs: the flags hold everything dsauto prices


def test_dsauto_own_file_reads_back_without_the_model_named(tmp_path):
    """The file states the tokenizer's vocabulary in a comment, which the reader takes where no
    --vocab-size is given: dsauto's own megatron_args.txt of a model the flags describe reads back
    alone; another launch without the vocabulary is still refused."""
    plan = make_plan("llama3-8b", "h100-80gb", nodes=1, global_batch=64, seq_len=8192, engine="megatron", tp=2)
    path = write_megatron_args(plan, tmp_path / "megatron_args.txt")
    launch = read_megatron_args(path)
    assert launch.model.vocab_size == 128256
    [again] = find_plans(make_problem(launch.model, "h100-80gb", nodes=1, **launch.train, **launch.pins))
    assert again.prediction == plan.prediction
    bare = tmp_path / "bare.txt"
    bare.write_text("\n".join(line for line in path.read_text().splitlines() if "Vocabulary" not in line))
    with pytest.raises(DsautoError, match="describes the model but not its vocabulary"):
        read_megatron_args(bare)


def test_a_gated_gelu_and_windowed_model_reads_back(tmp_path):
    """Gemma 2's GeGLU is launched as --quick-geglu and its alternating windows as --window-size and
    --window-attn-skip-freq: dsauto's own file reads back into the same plan, with no flag unread."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DsautoWarning)
        model = load_model(str(CONFIGS / "gemma-2-9b.json"))
    plan = make_plan(model, "h100-80gb", nodes=1, global_batch=64, seq_len=8192, engine="megatron")
    path = write_megatron_args(plan, tmp_path / "megatron_args.txt")
    assert "--quick-geglu" in path.read_text() and "--window-size 4095,0" in path.read_text()
    launch = read_megatron_args(path, plan.model)
    assert launch.unknown == []
    [again] = find_plans(make_problem(launch.model, "h100-80gb", nodes=1, **launch.train, **launch.pins))
    assert again.prediction == plan.prediction
    flags_alone = read_megatron_args(path).model  # the flags' own model: the window and the gate read
    assert (flags_alone.mlp, flags_alone.sliding_window, flags_alone.global_attention_every) == ("geglu", 4096, 2)
    with pytest.raises(DsautoError, match="describes a model with sliding_window 4096"):
        read_megatron_args(path, dataclasses.replace(plan.model, sliding_window=2048))


def test_a_launch_without_the_models_window_is_refused_and_windows_parse_as_megatron_takes_them(tmp_path):
    """A launch that sets no --window-size attends in full; a named model whose window slides over its
    sequences is another model. --window-size takes Megatron's tuple spellings: '(N,0)' and '-1,0'."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DsautoWarning)
        mistral = load_model(str(CONFIGS / "mistral-7b-v0.1.json"))
    plan = make_plan(mistral, "h100-80gb", nodes=1, global_batch=64, seq_len=8192, engine="megatron")
    path = write_megatron_args(plan, tmp_path / "megatron_args.txt")
    text = path.read_text()
    assert "--window-size 4095,0" in text
    path.write_text(text.replace("--window-size 4095,0\n", ""))
    with pytest.raises(DsautoError, match=r"sets no --window-size, so its 8192-token sequences attend in full, and "
                                          r"--model .* slides a 4096-token window over them; add --window-size 4095,0"):
        read_megatron_args(path, plan.model)
    path.write_text(text.replace("--window-size 4095,0", "--window-size (4095,0)"))
    assert read_megatron_args(path).model.sliding_window == 4096
    path.write_text(text.replace("--window-size 4095,0", "--window-size -1,0"))
    assert not read_megatron_args(path).model.sliding_window
    path.write_text(text.replace("--window-size 4095,0", "--window-size 4095,4"))
    with pytest.raises(DsautoError, match="dsauto plans causal windows"):
        read_megatron_args(path)


def test_gpt_oss_launched_as_megatron_lm_does_reads_as_gpt_oss(tmp_path):
    """dsauto's file launches gpt-oss as Megatron-LM builds it (--quick-geglu --glu-linear-offset 1
    --activation-func-clamp-value 7, --softmax-type learnable, every linear layer biased), and reads
    back as the model, named or not."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DsautoWarning)
        model = load_model(str(CONFIGS / "gpt-oss-20b.json"))
    plan = make_plan(model, "h100-80gb", nodes=1, global_batch=64, seq_len=4096, engine="megatron")
    path = write_megatron_args(plan, tmp_path / "megatron_args.txt")
    assert "--quick-geglu\n--glu-linear-offset 1\n--activation-func-clamp-value 7\n" in path.read_text()
    launch = read_megatron_args(path, plan.model)
    assert launch.unknown == [] and launch.model == plan.model
    text = path.read_text()
    # read without the model (whose YaRN positions dsauto reads from the config alone)
    path.write_text(text.replace("--position-embedding-type yarn", "--position-embedding-type rope"))
    described = read_megatron_args(path).model
    assert (described.mlp, described.glu_clamp, described.attention_sinks, described.linear_bias) == (
        "swiglu", 7.0, True, True)
    # the router's and the experts' biases too: the parameters of the model the flags build
    assert described.num_parameters() == plan.model.num_parameters()
    path.write_text(text.replace("--softmax-type learnable\n", ""))
    with pytest.raises(DsautoError, match="does not set --softmax-type learnable, and --model openai/gpt-oss-20b has "
                                          "learned attention sinks"):
        read_megatron_args(path, plan.model)
    path.write_text(text.replace("--quick-geglu\n", "--quick-geglu\n--disable-bias-linear\n"))
    with pytest.raises(DsautoError, match="without biases on its linear layers"):
        read_megatron_args(path, plan.model)
    path.write_text(text.replace("--quick-geglu\n--glu-linear-offset 1\n--activation-func-clamp-value 7\n", "--swiglu\n"))
    with pytest.raises(DsautoError, match="describes a swiglu MLP, and --model openai/gpt-oss-20b has a swiglu MLP "
                                          "clamped at 7"):
        read_megatron_args(path, plan.model)  # YaRN: the named model is taken, its gate checked
    path.write_text(text.replace("--quick-geglu\n", "--swiglu\n"))
    with pytest.raises(DsautoError, match="sets --glu-linear-offset without --quick-geglu"):
        read_megatron_args(path, plan.model)
    path.write_text(text.replace("--softmax-type learnable", "--softmax-type off-by-one")
                    .replace("--position-embedding-type yarn", "--position-embedding-type rope"))
    with pytest.raises(DsautoError, match="--softmax-type off-by-one; dsauto prices vanilla and learnable"):
        read_megatron_args(path)


MINIMAL = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --vocab-size 4096 "
           "--micro-batch-size 2 --global-batch-size 8 --tensor-model-parallel-size 2 "
           "--pipeline-model-parallel-size 2 --lr 3e-4 --train-iters 100 --data-path /data/x")


def test_megatron_cores_own_layers_price_eager_attention():
    for extra in ("--transformer-impl local", "--attention-backend local", "--attention-backend unfused"):
        assert parse_megatron_args((MINIMAL + " " + extra).split()).train["flash_attention"] is False
    assert "flash_attention" not in parse_megatron_args(MINIMAL.split()).train


def test_what_a_launch_leaves_out_reads_as_megatron_lms_defaults():
    launch = parse_megatron_args(MINIMAL.split())
    model = launch.model
    # Megatron-LM's GPT: GeLU fused with the biases (tanh), LayerNorm, learned positions, tied head, dropout 0.1
    assert (model.mlp, model.gelu_tanh, model.norm, model.position_embedding, model.tied_embeddings,
            model.linear_bias, model.dropout, model.ffn_hidden_size, model.max_position_embeddings) == (
        "gelu", True, "layernorm", "learned", True, True, True, 1024, 256)
    assert launch.train == {"global_batch": 8, "seq_len": 256, "dtype": "fp32"}
    pins = launch.pins
    assert (pins["tp"], pins["pp"], pins["micro_batch"], pins["sequence_parallel"], pins["zero_stage"],
            pins["checkpoint"], pins["stage_layers"], pins["vpp"], pins["offload"], pins["fp8"]) == (
        2, 2, 2, False, 0, False, "even", 1, "none", False)
    assert launch.unknown == []  # the learning rate, iterations and data change nothing priced
    # Megatron-LM reduces the gradients after the backward unless told otherwise: priced so, no note
    assert pins["overlap_grad_reduce"] is False and "overlap_param_gather" not in pins  # ZeRO 0 gathers none
    assert launch.notes == []


EXPERTS = "--num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall --moe-grouped-gemm"


def test_the_routers_balancing_and_its_loss_weights_read_as_priced():
    """Megatron-LM's balancing types (several at once) add loss terms or rebalance scores: none changes
    what dsauto prices, so a launch's are read, not named as unknown; a dense launch ignores them."""
    launch = parse_megatron_args(f"{MINIMAL} {EXPERTS} --moe-router-load-balancing-type seq_aux_loss global_aux_loss "
                                 f"--moe-aux-loss-coeff 1e-3 1e-4 --moe-z-loss-coeff 1e-3".split())
    assert launch.unknown == [] and launch.pins["expert_capacity_factor"] is None
    sinkhorn = parse_megatron_args(f"{MINIMAL} {EXPERTS} --moe-router-load-balancing-type sinkhorn".split())
    assert sinkhorn.unknown == [] and sinkhorn.pins["ep"] == 1
    with pytest.raises(DsautoError, match="balanced, which is none of Megatron-LM's"):  # argparse's choices
        parse_megatron_args(f"{MINIMAL} --moe-router-load-balancing-type balanced".split())
    for extra, message in (("--moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 1e-3",
                            "gives 2 --moe-router-load-balancing-type values and 1 --moe-aux-loss-coeff"),
                           ("--moe-router-load-balancing-type sinkhorn --moe-aux-loss-coeff 1e-2",
                            "sinkhorn and a nonzero --moe-aux-loss-coeff 1e-2, which Megatron-core's router refuses")):
        with pytest.raises(DsautoError, match=message):
            parse_megatron_args(f"{MINIMAL} {EXPERTS} {extra}".split())


def test_a_flag_given_twice_keeps_its_last_value_as_argparse_does():
    launch = parse_megatron_args(f"{MINIMAL} --tensor-model-parallel-size 4 --lr 1e-4 --lr 2e-4".split())
    assert launch.pins["tp"] == 4
    assert launch.notes == ["the arguments sets --tensor-model-parallel-size twice ('2', then '4'); Megatron-LM "
                            "takes the last, and so does dsauto."]  # --lr, which nothing priced reads, unsaid


def test_megatron_lms_batch_schedules_and_fp8_formats_read_as_priced():
    """A ramp-up reaches the launch's batch, whose steps are priced (said); a step schedule has no one
    batch, and Megatron-LM refuses it beside --global-batch-size; E4M3 alone is priced as hybrid FP8."""
    ramp = parse_megatron_args(f"{MINIMAL} --rampup-batch-size 2 2 1000".split())
    assert ramp.train["global_batch"] == 8 and ramp.unknown == []
    assert ramp.notes == ["the arguments ramps its batch up (--rampup-batch-size), and dsauto prices the steps of "
                          "the batch it reaches, --global-batch-size."]
    with pytest.raises(DsautoError, match="beside --global-batch-size, which Megatron-LM refuses"):
        parse_megatron_args(f"{MINIMAL} --step-batch-size-schedule 0:4,100:8".split())
    e4m3 = parse_megatron_args(f"{MINIMAL} --bf16 --fp8-format e4m3".split())
    assert e4m3.pins["fp8"] and "prices it as hybrid (E5M2 gradients)" in e4m3.notes[0]
    with pytest.raises(DsautoError, match="sets --fp8-format e5m2; dsauto prices hybrid and e4m3"):
        parse_megatron_args(f"{MINIMAL} --bf16 --fp8-format e5m2".split())


def test_dsautos_own_encoder_arguments_read_back_as_an_encoder(tmp_path):
    """dsauto's own file for BERT has no script: pretrain_bert.py's --bert-no-binary-head says encoder."""
    plan = make_plan("bert-large", "a100-80gb", nodes=1, global_batch=64, seq_len=512, engine="megatron")
    path = write_megatron_args(plan, tmp_path / "megatron_args.txt")
    assert read_megatron_args(path, plan.model).model == plan.model
    assert read_megatron_args(path).model.architecture == "encoder"


def test_the_training_script_decides_the_architecture(tmp_path):
    """pretrain_bert.py trains an encoder (bidirectional attention), its next-sentence head left out and
    said; pretrain_gpt.py a decoder; another of Megatron-LM's pretrain_ scripts is refused, a script of
    one's own priced as pretrain_gpt.py's decoder, said; a named model of the other kind is refused."""
    body = " " + MINIMAL.replace(" --data-path /data/x", "") + "\n"
    script = tmp_path / "train.sh"
    script.write_text("torchrun --nproc_per_node 4 pretrain_bert.py" + body)
    bert = read_megatron_args(script)
    assert bert.model.architecture == "encoder" and bert.model.type_vocab_size == 2
    assert "trains BERT's next-sentence head (no --bert-no-binary-head)" in bert.notes[0]
    script.write_text("torchrun --nproc_per_node 4 pretrain_bert.py --bert-no-binary-head" + body)
    assert read_megatron_args(script).model.type_vocab_size == 0
    with pytest.raises(DsautoError, match="trains an encoder .pretrain_bert.py., and --model gpt-tiny is a decoder"):
        read_megatron_args(script, load_model("gpt-tiny"))
    script.write_text("torchrun --nproc_per_node 4 pretrain_t5.py" + body)
    with pytest.raises(DsautoError, match="runs pretrain_t5.py; dsauto prices the models of Megatron-LM's "
                                          "pretrain_gpt.py and pretrain_bert.py"):
        read_megatron_args(script)
    script.write_text("SCRIPT=my_train.py\ntorchrun --nproc_per_node 4 $SCRIPT" + body)
    own = read_megatron_args(script)
    assert own.model.architecture == "decoder" and own.pins["tp"] == 2
    assert own.notes[0].endswith("runs my_train.py, not Megatron-LM's pretrain_gpt.py or pretrain_bert.py, and "
                                 "dsauto prices its model as pretrain_gpt.py builds one from these flags (a causal "
                                 "decoder).")


def test_megatron_fsdp_launches_without_overlap_are_named_as_priced_overlapped():
    launch = parse_megatron_args(f"{MINIMAL} --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
                                 f"--overlap-grad-reduce".split())
    assert "overlap_grad_reduce" not in launch.pins
    assert launch.notes == ["the arguments does not set --overlap-param-gather, and dsauto prices Megatron-FSDP's "
                            "communication overlapped as its plans run it; add them to run as priced."]


def test_transformer_engines_fused_loss_is_named_as_priced_high():
    """Transformer Engine's fused cross entropy keeps the 16-bit logits alone, where dsauto prices
    Megatron-core's native loss with its fp32 softmax: 4 bytes a padded vocabulary entry (on its tp
    rank) and token more, named with its size; the native fusion keeps that softmax too."""
    fused = "--bf16 --overlap-grad-reduce --cross-entropy-loss-fusion --cross-entropy-fusion-impl"
    te = parse_megatron_args(f"{MINIMAL} {fused} te".split())
    vocab = te.model.padded_vocab_size(2) // 2  # tp 2
    size = format_bytes(4 * vocab * 2 * 256)  # micro-batch 2 of 256 tokens
    assert te.notes == [f"the arguments computes the loss with Transformer Engine's fused cross entropy "
                        f"(--cross-entropy-fusion-impl te), which keeps no fp32 softmax beside the logits, and dsauto "
                        f"prices Megatron-core's native loss, 4 bytes a vocabulary entry and token more ({size} at "
                        f"its micro-batch), so the last pipeline stage's peak is priced up to that much above what "
                        f"it runs."]
    assert parse_megatron_args(f"{MINIMAL} {fused} native".split()).notes == []
    assert parse_megatron_args(f"{MINIMAL} --bf16 --overlap-grad-reduce --cross-entropy-loss-fusion".split()).notes == []


@pytest.mark.parametrize("extra, pins", [
    ("--recompute-activations", {"recompute_modules": "core_attn"}),
    ("--recompute-granularity selective --recompute-modules core_attn mlp", {"recompute_modules": "core_attn,mlp"}),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1", {"checkpoint": True}),
    ("--recompute-granularity full --recompute-method block --recompute-num-layers 1", {"recompute_num_layers": 1}),
    ("--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather",
     {"zero_stage": 1, "overlap_grad_reduce": True, "overlap_param_gather": True}),
    ("--use-distributed-optimizer --overlap-grad-reduce",
     {"zero_stage": 1, "overlap_grad_reduce": True, "overlap_param_gather": False}),
    ("--use-distributed-optimizer", {"overlap_grad_reduce": False, "overlap_param_gather": False}),
    ("--overlap-grad-reduce", {"zero_stage": 0, "overlap_grad_reduce": True, "overlap_param_gather": None}),
    ("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params", {"zero_stage": 3}),
    ("--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 3", {"stage_layers": (1, 3)}),
    ("--num-layers-per-virtual-pipeline-stage 1", {"vpp": 2}),
    ("--pipeline-model-parallel-layout Et|t|t|tL", {"vpp": 2, "stage_layers": (2, 2)}),
    ("--bf16 --fp8-format hybrid --fp8-recipe delayed --fp8-param-gather",
     {"fp8": True, "fp8_recipe": "delayed", "fp8_param_gather": True}),
    ("--sequence-parallel --tp-comm-overlap --grad-reduce-in-bf16",
     {"sequence_parallel": True, "tp_comm_overlap": True, "grad_reduce_in_fp32": False}),
    ("--attention-backend flash", {"attention_kernel": "flash"}),
    ("--bf16 --use-distributed-optimizer --use-precision-aware-optimizer --exp-avg-dtype bf16 "
     "--exp-avg-sq-dtype bf16", {"precision_aware_optimizer": "bf16", "grad_reduce_in_fp32": True}),
    ("--bf16 --use-distributed-optimizer --use-precision-aware-optimizer --main-grads-dtype bf16",
     {"precision_aware_optimizer": "fp32", "grad_reduce_in_fp32": False}),
    ("--use-distributed-optimizer --optimizer-cpu-offload --use-precision-aware-optimizer",
     {"offload": "optimizer", "precision_aware_optimizer": None}),  # the offload's companion
    ("--use-distributed-optimizer", {"dist_opt_instances": 1}),  # Megatron-LM's one instance
    ("--context-parallel-size 2", {"cp": 2, "cp_comm_type": "p2p"}),  # its ring by default
    ("", {"recompute_modules": "none", "checkpoint": False}),  # nothing recomputed, selectively either
    ("--num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall --moe-grouped-gemm "
     "--expert-model-parallel-size 2", {"ep": 2}),
])
def test_each_choice_a_launch_fixes_becomes_a_pin(extra, pins):
    launch = parse_megatron_args((MINIMAL + " " + extra).split())
    assert {key: launch.pins.get(key) for key in pins} == pins


@pytest.mark.parametrize("extra, message", [
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 2", "uniform recomputation"),
    ("--recompute-granularity full", "without --recompute-method"),
    ("--use-torch-fsdp2", "dsauto prices Megatron-FSDP"),
    (f"{EXPERTS} --moe-expert-capacity-factor 1.0 --moe-router-load-balancing-type sinkhorn",
     "with --moe-router-load-balancing-type sinkhorn, which Megatron-core refuses .it drops tokens only under aux_loss"),
    (EXPERTS.replace("alltoall", "flex") + " --moe-flex-dispatcher-backend hybridep",
     "dispatches the experts' tokens with the flex dispatcher's hybridep backend .--moe-flex-dispatcher-backend."),
    (f"{EXPERTS} --moe-router-load-balancing-type aux_loss balanced", "sets --moe-router-load-balancing-type balanced, "
                                                                      "which is none of Megatron-LM's"),
    ("--overlap-grad-reduce --overlap-param-gather", "without --use-distributed-optimizer or --use-megatron-fsdp"),
    ("--use-distributed-optimizer --overlap-param-gather", "without --overlap-grad-reduce, which Megatron-LM refuses"),
    ("--optimizer-cpu-offload --optimizer-offload-fraction 0.5", "offloads part of the optimizer"),
    ("--pipeline-model-parallel-layout Et*3|tmL", "places 1 multi-token-prediction layer.s., and it sets no --mtp-num-layers"),
    ("--pipeline-model-parallel-layout Et*3|txL", "does not read"),
    ("--pipeline-model-parallel-layout Et|t*2|tL", "not a multiple of pp 2"),
    ("--decoder-first-pipeline-num-layers 5", "no even split"),
    ("--hidden-dropout 0.0", "dropout to attention only"),
    ("--num-experts 8 --moe-router-topk 2", "dispatches the experts' tokens with allgather"),
    ("--position-embedding-type none", "does not price a model without position embeddings"),
    ("--normalization LayerNorm1P", "dsauto prices LayerNorm and RMSNorm"),
    ("--seq-length", "gives --seq-length no value"),
    ("--context-parallel-size 0", "give a number of at least 1"),
    ("--use-megatron-fsdp", "its default depends on the version"),
    ("--context-parallel-size 2 --cp-comm-type a2a+p2p", "dsauto prices p2p, all_gather and a2a"),
    ("--no-bias-swiglu-fusion", "an unfused SwiGLU"),
    ("--exp-avg-dtype bf16", "without --use-precision-aware-optimizer"),
    ("--bf16 --use-distributed-optimizer --use-precision-aware-optimizer --exp-avg-dtype bf16 "
     "--exp-avg-sq-dtype fp32", "both in one dtype"),
    ("--use-precision-aware-optimizer --main-params-dtype fp16", "keeps the main weights in fp16"),
    ("--bf16 --use-precision-aware-optimizer", "without the distributed optimizer"),
    ("--fp16 --use-distributed-optimizer --use-precision-aware-optimizer", "under --bf16 only"),
    ("--optimizer-cpu-offload --use-precision-aware-optimizer --exp-avg-dtype bf16", "the optimizer offloaded"),
    ("--expert-model-parallel-size 2", "expert parallelism for a model without experts"),
    # a training choice, not the model's: no hint to name the model
    ("--bf16 --fp8-format hybrid --fp8-recipe blockwise", r"sets --fp8-recipe blockwise; dsauto prices delayed and "
                                                          r"tensorwise\.$"),
])
def test_what_dsauto_does_not_price_is_refused_in_one_sentence(extra, message):
    with pytest.raises(DsautoError, match=message):
        parse_megatron_args((MINIMAL + " " + extra).split())


def test_a_launch_needs_its_vocabulary_or_a_named_model():
    words = [word for word in MINIMAL.split() if word not in ("--vocab-size", "4096")]
    with pytest.raises(DsautoError, match="add --vocab-size N, or name the model with --model"):
        parse_megatron_args(words)
    gpt = dataclasses.replace(load_model("gpt-tiny"), num_layers=4, hidden_size=256, num_attention_heads=4,
                              ffn_hidden_size=1024, max_position_embeddings=256, tied_embeddings=True, dropout=True)
    assert parse_megatron_args(words + ["--no-bias-gelu-fusion"], model=gpt).model is gpt
    # What the flags set of the numerics and the GeLU's form, the plan takes from the launch, saying so.
    fused = parse_megatron_args(words, model=gpt)
    assert fused.model == dataclasses.replace(gpt, gelu_tanh=True)
    assert fused.notes == ["the arguments sets no --no-bias-gelu-fusion, so GeLU's tanh approximation fused with its "
                           "bias on, and --model gpt-tiny has off: the plan trains the launch's."]
    with pytest.raises(DsautoError, match="num_layers 4, and --model gpt-tiny has 6"):
        parse_megatron_args(words, model=dataclasses.replace(gpt, num_layers=6))
    # Megatron-LM's defaults count as said: no --hidden-dropout 0 means dropout, no flag the biases.
    with pytest.raises(DsautoError, match="dropout True, and --model gpt-tiny has False"):
        parse_megatron_args(words, model=dataclasses.replace(gpt, dropout=False))
    with pytest.raises(DsautoError, match="vocab_size 4096, and --model gpt-tiny has 50257"):
        parse_megatron_args(MINIMAL.split(), model=dataclasses.replace(gpt, vocab_size=50257))


@pytest.mark.filterwarnings("ignore:.*--ddp-bucket-size:UserWarning")
def test_the_command_line_plans_a_launch_and_refuses_contradictions(tmp_path, capsys):
    plan = make_plan("llama3-8b", "h100-80gb", nodes=1, global_batch=64, seq_len=8192, engine="megatron", tp=2)
    path = write_megatron_args(plan, tmp_path / "launch.txt")
    common = ["--megatron-args", str(path), "--model", "llama3-8b", "--hardware", "h100-80gb"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DsautoWarning)  # dsauto's own file reads back without a word
        assert main(["tune", *common, "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "megatron_args.txt").read_text().split("\n")[4:] == path.read_text().split("\n")[4:]
    other = tmp_path / "other.txt"
    other.write_text(path.read_text().replace(f"--ddp-bucket-size {megatron_bucket_params(plan)}",
                                              "--ddp-bucket-size 40000000"))
    with pytest.warns(DsautoWarning, match=r"sets --ddp-bucket-size 40000000, and dsauto prices the gradient buckets "
                                           rf"of its own plan, {megatron_bucket_params(plan)} parameters"):
        assert main(["plan", "--megatron-args", str(other), "--model", "llama3-8b", "--hardware", "h100-80gb"]) == 0
    capsys.readouterr()
    assert main(["plan", *common, "--tp", "4"]) == 2
    assert "--megatron-args fixes tp = 2 and the command line gives 4; drop one of them." in capsys.readouterr().err
    assert main(["plan", *common, "--tp", "2", "--recompute-modules", "none"]) == 0  # the same values repeated
    described = tmp_path / "described.txt"
    described.write_text(path.read_text() + "--vocab-size 128256\n")
    capsys.readouterr()
    assert main(["tune", "--megatron-args", str(described), "--hardware", "h100-80gb", "--trials", "2", "--out",
                 str(tmp_path / "t")]) == 2
    assert "name it with --model too" in capsys.readouterr().err
    path.write_text(path.read_text() + "--some-new-flag 3\n")
    with pytest.warns(DsautoWarning, match=r"sets --some-new-flag, which dsauto does not read"):
        assert main(["plan", *common]) == 0
    path.write_text("\n".join(line for line in path.read_text().splitlines() if "Vocabulary" not in line))
    assert main(["plan", "--megatron-args", str(path), "--hardware", "h100-80gb"]) == 2  # a launch of its own
    assert "add --vocab-size N, or name the model with --model" in capsys.readouterr().err
    assert main(["plan", "--megatron-args", str(tmp_path / "missing.txt")]) == 2
    assert "cannot read the Megatron-LM arguments" in capsys.readouterr().err


def test_megatron_lms_own_defaults_for_what_a_launch_leaves_out():
    swiglu = parse_megatron_args((MINIMAL + " --swiglu --use-rotary-position-embeddings").split()).model
    assert swiglu.ffn_hidden_size == 640  # validate_args: int(4 x 256 x 2 / 3 / 64) x 64
    assert swiglu.position_embedding == "rope"  # the older spelling still sets rope
    moe = parse_megatron_args((MINIMAL + " --num-experts 4 --moe-token-dispatcher-type flex --moe-grouped-gemm").split())
    assert (moe.pins["ep"], moe.pins["etp"], moe.pins["expert_dispatcher"]) == (1, 2, "deepep")  # etp = tp
    # Megatron-core 0.12-0.16's older spelling of the deepep backend is read as it, not warned about
    older = MINIMAL + " --num-experts 4 --moe-token-dispatcher-type flex --moe-enable-deepep --moe-grouped-gemm"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parse_megatron_args(older.split()).pins["expert_dispatcher"] == "deepep"
    with pytest.raises(DsautoError, match="runs DeepEP only with the flex dispatcher's deepep backend"):
        parse_megatron_args(older.replace("flex", "alltoall").split())
    with pytest.raises(DsautoError, match="--global-batch-size"):
        parse_megatron_args([word for word in MINIMAL.split() if word not in ("--global-batch-size", "8")])
    # Unfused attention in 16 bits: Megatron-LM's softmax keeps 16 bits unless it runs in fp32 through
    # torch (--attention-softmax-in-fp32 with the fused kernel off, or keys beyond the kernel's 4096).
    def softmax_fp32(extra: str, seq: int = 256) -> bool | None:
        words = (MINIMAL.replace("--seq-length 256", f"--seq-length {seq} --max-position-embeddings {seq}")
                 + " --bf16 --transformer-impl local " + extra).split()
        return parse_megatron_args(words).pins.get("attention_softmax_in_fp32")
    assert softmax_fp32("") is False
    assert softmax_fp32("--attention-softmax-in-fp32") is False  # the fused kernel takes 256 keys
    assert softmax_fp32("--attention-softmax-in-fp32 --no-masked-softmax-fusion") is True
    assert softmax_fp32("--apply-query-key-layer-scaling --no-masked-softmax-fusion") is True
    assert softmax_fp32("--attention-softmax-in-fp32", seq=8192) is True
    eager = parse_megatron_args((MINIMAL + " --transformer-impl local").split())  # fp32: nothing to choose
    assert "attention_softmax_in_fp32" not in eager.pins
    # Transformer Engine's layers (the default impl) run their own unfused attention: its fused masked
    # softmax (16 bits) for 16 < s < 16384 keys, a multiple of 8, and micro-batch x heads per rank a
    # multiple of 4, unless NVTE_MASKED_SOFTMAX_FUSION=0; else torch's in fp32. Megatron's flags do not reach it.
    te = (MINIMAL + " --bf16 --attention-backend unfused --attention-softmax-in-fp32 --no-masked-softmax-fusion").split()
    assert parse_megatron_args(te).pins["attention_softmax_in_fp32"] is False  # 2 x 4 / 2 heads: 4
    unfusable = [w if w != "2" or i != te.index("--micro-batch-size") + 1 else "1" for i, w in enumerate(te)]
    assert parse_megatron_args(unfusable).pins["attention_softmax_in_fp32"] is True  # 1 x 2 batches
    off = parse_megatron_args(te, environment={"NVTE_MASKED_SOFTMAX_FUSION": "0"})
    assert off.pins["attention_softmax_in_fp32"] is True
    # --attention-backend local swaps in Megatron-core's own attention, which the Megatron flags reach.
    local = (MINIMAL + " --bf16 --attention-backend local --attention-softmax-in-fp32 --no-masked-softmax-fusion")
    assert parse_megatron_args(local.split()).pins["attention_softmax_in_fp32"] is True
    # Without --seq-length the launch's softmax is not known: dsauto's default, and a note.
    words = "--bf16 --attention-backend unfused --micro-batch-size 2 --global-batch-size 8".split()
    unknown = parse_megatron_args(words, model=load_model("gpt-tiny"))  # the sequence left to the command line
    assert "attention_softmax_in_fp32" not in unknown.pins and any("--seq-length" in n for n in unknown.notes)


@pytest.mark.parametrize("text, setting", [
    ("export NVTE_MASKED_SOFTMAX_FUSION=0\n", "0"),
    ('export NVTE_MASKED_SOFTMAX_FUSION="0"\n', "0"),
    ("NVTE_MASKED_SOFTMAX_FUSION=0 torchrun pretrain_gpt.py\n", "0"),
    ("# Launch environment: NVTE_MASKED_SOFTMAX_FUSION=0, for the unfused attention's fp32 softmax.\n", "0"),
    ("# export NVTE_MASKED_SOFTMAX_FUSION=0\n", None),  # commented out: sets nothing
    ("export NVTE_MASKED_SOFTMAX_FUSION=0\nexport NVTE_MASKED_SOFTMAX_FUSION='1'\r\n", "1"),  # the last one
    ("export CUDA_DEVICE_MAX_CONNECTIONS=1\n", None),  # not one dsauto reads
])
def test_a_launch_files_environment_is_read_where_it_is_set(text, setting):
    from dsauto.engines.megatron_args import launch_environment

    assert launch_environment(text).get("NVTE_MASKED_SOFTMAX_FUSION") == setting


def test_the_launch_environment_of_dsautos_own_file_reads_back(tmp_path):
    """A plan with unfused attention priced with the fp32 softmax, where Transformer Engine would fuse it,
    states NVTE_MASKED_SOFTMAX_FUSION=0 in its launch environment, and the reader takes it."""
    plan = make_plan("llama2-7b", "a100-80gb", nodes=1, global_batch=64, seq_len=1024, engine="megatron",
                     flash_attention=False, tp=1, pp=1, micro_batch=1, zero_stage=1, checkpoint=True)
    path = write_megatron_args(plan, tmp_path / "megatron_args.txt")
    assert "# Launch environment: NVTE_MASKED_SOFTMAX_FUSION=0" in path.read_text()
    launch = read_megatron_args(path, plan.model)
    assert launch.environment == {"NVTE_MASKED_SOFTMAX_FUSION": "0"}
    assert launch.pins["attention_softmax_in_fp32"] is True
    script = tmp_path / "launch.sh"
    script.write_text("export NVTE_MASKED_SOFTMAX_FUSION=1\ntorchrun pretrain_gpt.py " + " ".join(
        line for line in path.read_text().splitlines() if not line.startswith("#")) + "\n")
    assert read_megatron_args(script, plan.model).pins["attention_softmax_in_fp32"] is False


def test_a_named_mixture_of_experts_takes_the_launchs_expert_degrees():
    gpt = load_model("gpt-tiny")
    moe = dataclasses.replace(gpt, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=gpt.ffn_hidden_size)
    words = ("--tensor-model-parallel-size 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
             "--moe-grouped-gemm --global-batch-size 8 --micro-batch-size 1").split()
    launch = parse_megatron_args(words, model=moe)
    assert (launch.pins["ep"], launch.pins["etp"]) == (2, 2)
    with pytest.raises(DsautoError, match="allgather"):
        parse_megatron_args(words[:4] + words[6:], model=moe)  # Megatron-LM's default dispatcher


def test_a_launch_script_reads_as_its_flags(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text("# a launch as people write it\n"
                      "torchrun --nproc_per_node=8 --nnodes 1 pretrain_gpt.py \\\n"
                      "    " + MINIMAL.replace(" --data-path /data/x", "") + " \\\n"
                      "    --data-path 0.5 /data/a 0.5 /data/b --wandb-exp-name 'run#3'  # two datasets\n")
    launch = read_megatron_args(script)
    assert launch.pins["tp"] == 2 and launch.train["global_batch"] == 8 and launch.unknown == []


def test_a_script_of_bash_arrays_reads_as_the_command_they_build(tmp_path):
    """Megatron-LM's example scripts gather their flags in bash arrays and size the launch with
    variables: the arrays (appended to as well) expand where ``${NAME[@]}`` stands, quoted or not,
    and a variable the file sets to one value where ``$NAME`` does; one set outside the file stays."""
    lines = MINIMAL.replace(" --data-path /data/x", "").split(" --")
    model, rest = " --".join(lines[:4]), "--" + " --".join(lines[4:])
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/bash\n"
                      "GPUS_PER_NODE=4\nNUM_NODES=2\nexport CKPT=$1\n"
                      "DISTRIBUTED_ARGS=(\n    --nproc_per_node $GPUS_PER_NODE\n    --nnodes ${NUM_NODES}\n)\n"
                      f"MODEL_ARGS=(\n    {model}  # the shape\n)\n"
                      "MODEL_ARGS+=(--vocab-size 4096)\n"
                      f"REST=(\n    {rest.replace(' --vocab-size 4096', '')}\n)\n"
                      "torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \\\n"
                      "    ${MODEL_ARGS[@]} \"${REST[@]}\" --save $CKPT\n")
    launch = read_megatron_args(script)
    assert launch.world == {"nodes": 2, "gpus_per_node": 4}
    assert launch.pins["tp"] == 2 and launch.train["global_batch"] == 8 and launch.unknown == []
    assert launch.model.num_layers == 4 and launch.model.vocab_size == 4096


def test_shell_expansion_reads_as_bash_would(tmp_path):
    """A comment holding parentheses, ``$(hostname)`` and a quoted ``)`` do not close an array; an
    unquoted value with a quote and a blank splits at the blank, as bash splits it; an assignment in a
    branch that depends on the job sets nothing, and is reported; nothing inside single quotes is
    expanded."""
    from dsauto.engines.megatron_args import expand_shell_variables

    text = ("NAME=\"bob's run\"\nTP=4\nif [ -n \"$BIG\" ]; then\n    TP=8\nfi\n"
            "ARGS=(\n    --tensor-model-parallel-size $TP   # TP (inside a node)\n"
            "    --master_addr $(hostname) --tag ')' --note 'a $TP'\n    --pipeline-model-parallel-size 2\n)\n"
            "torchrun x.py \"${ARGS[@]}\" --wandb-exp-name $NAME\n")
    unevaluated: dict[str, str] = {}
    words = shlex.split(expand_shell_variables(text, unevaluated=unevaluated), comments=True)
    command = words[words.index("torchrun"):]
    assert command == ["torchrun", "x.py", "--tensor-model-parallel-size", "4", "--master_addr", "$(hostname)",
                       "--tag", ")", "--note", "a $TP", "--pipeline-model-parallel-size", "2",
                       "--wandb-exp-name", "bob's", "run"]
    assert unevaluated == {"TP": '[ -n "$BIG" ]'}


def test_shell_defaults_and_arithmetic_read_as_bash_computes_them(tmp_path):
    """A launch script's ``${NAME:-default}`` takes the file's value, else the default (said in a
    note, since the job may set it), and ``$((...))`` is computed as bash computes it; arithmetic over
    a variable the file does not set stays as written, and its flag is then refused in one sentence."""
    from dsauto.engines.megatron_args import expand_shell_variables

    defaults: dict[str, str] = {}
    text = ("N=4\nTP=${TP:-2}\nA=$((N * 2 + 1))\nB=$(( (N - 10) / 3 ))\nC=$((-7 % N))\nE=\"\"\nY=\"a b\"\n"
            "M=\"1+1\"\nSIZE=4\n"
            "x.py --a $A --b $B --c $C --d $((X * 2)) --e $(( ${G:-8} * N )) --f ${R:=z} --g $R --h $((M * 2)) "
            "--i $((N / 0)) --j ${TP} --k \"${Q:-a b}\" --l ${NN:-${SLURM_NN:-3}} --m ${E:-5} --n ${E-6} "
            "--o \"${X:-$Y}\" --p ${TPS:-${SIZE}}\n")
    words = shlex.split(expand_shell_variables(text, defaults), comments=True)
    assert words[words.index("x.py"):] == [
        "x.py", "--a", "9", "--b", "-2", "--c", "-3", "--d", "$((X * 2))", "--e", "32", "--f", "z", "--g", "z",
        "--h", "$((M * 2))",  # a variable holding other text than a number: bash would evaluate it
        "--i", "$((N / 0))", "--j", "2", "--k", "a b", "--l", "3",
        "--m", "5", "--n",  # ':-' defaults an empty value too, '-' an unset one alone: unquoted, it is no word
        "--o", "a b", "--p", "4"]
    assert defaults == {"TP": "2", "G": "8", "R": "z", "Q": "a b", "SLURM_NN": "3", "NN": "3",
                        "X": "a b", "TPS": "4"}  # not E: the file sets it, empty

    # the same words as bash's, quotes and empty values included
    import subprocess

    script = ('X=\nT=""\nY="a  b"\nN=3\n'
              'set -- --a "${X-2}" --b ${T:-2} --c "${D:-"$Y"}" --d "${E:-$Y}" --e ${F:-"a}b"} '
              '--f ${G:-${H:-$((N * 4 - 1))}} --g "${T}" --h ${I:=5} --i $I\n')
    bash = subprocess.run(["bash", "-c", script + 'printf "%s\\n" "$@"'], capture_output=True, text=True,
                          check=True).stdout.split("\n")[:-1]
    ours = shlex.split(expand_shell_variables(script).splitlines()[-1], comments=True)[2:]
    assert ours == bash == ["--a", "", "--b", "2", "--c", "a  b", "--d", "a  b", "--e", "a}b", "--f", "11", "--g", "",
                            "--h", "5", "--i", "5"]

    flags = MINIMAL.replace("--micro-batch-size 2 --global-batch-size 8 --tensor-model-parallel-size 2",
                            "--micro-batch-size ${MBS:-2} --global-batch-size $((MBS_ALL * 4)) "
                            "--tensor-model-parallel-size $TP")
    script = tmp_path / "train.sh"
    script.write_text(f"TP=${{TP:-2}}\nMBS_ALL=2\ntorchrun pretrain_gpt.py {flags}\n")
    launch = read_megatron_args(script)
    assert launch.pins["tp"] == 2 and launch.train["global_batch"] == 8 and launch.pins["micro_batch"] == 2
    assert (f"{script} leaves TP, MBS to the job and dsauto takes their defaults (TP=2, MBS=2), as bash does "
            f"where the job does not set them; write the values the job runs into the file if they differ.") in launch.notes
    script.write_text(f"torchrun pretrain_gpt.py {flags.replace('$TP', '2')}\n")
    with pytest.raises(DsautoError, match=r"gives --global-batch-size '\$\(\(MBS_ALL \* 4\)\)', not a whole number"):
        read_megatron_args(script)


BASH_CASES = {
    # Megatron-LM's FP8 scripts: flags added in an if block over the file's own value
    "if block": ('DTYPE="fp8"\nARGS=(--bf16)\nif [[ "$DTYPE" == "fp8" ]]; then\n    ARGS+=(\n        "--fp8-format hybrid"\n'
                 '        "--fp8-param-gather"\n    )\nfi\nset -- ${ARGS[@]} "${ARGS[@]}"\n'),
    "nested elif, then on its own line": ('A=1\nB=2\nif [ $A -eq 1 ]; then\n  if [ $B -gt 5 ]; then X=big\n'
                                          '  elif [ $B -ge 2 ]\n  then\n    X=mid\n  else\n    X=small\n  fi\n'
                                          'else\n  X=none\nfi\nset -- $X\n'),
    "commands after then, else and fi": ('A=1\nif [ "$A" = 1 ]; then X=a\nelse X=b\n  Y=c\nfi; Z=2\nset -- $X ${Y:-none} $Z\n'),
    "one-line if and lists": ('D=fp8\nARGS=(--bf16)\nif [ "$D" = fp8 ]; then ARGS+=(--fp8-format hybrid); fi\n'
                              '[[ $D == fp* ]] && ARGS+=(--x)\n[[ $D == bf* ]] && ARGS+=(--y)\n[[ $D == bf* ]] || ARGS+=(--z)\n'
                              'set -- "${ARGS[@]}"\n'),
    "quoted patterns are literal": ('A=fp8\nR=()\n[ "$A" = "fp*" ] && R+=(a)\n[[ $A == "fp*" ]] && R+=(b)\n'
                                    '[[ $A == fp* ]] && R+=(c)\n[[ $A =~ ^fp8 ]] && R+=(d)\n[[ $A =~ "^fp8" ]] && R+=(e)\n'
                                    'set -- "${R[@]}"\n'),
    "&& binds tighter inside a test": ('R=()\nif [[ 1 == 1 || 1 == 2 && 1 == 3 ]]; then R+=(t); else R+=(f); fi\n'
                                       'if [ 1 = 1 -o 1 = 2 -a 1 = 3 ]; then R+=(t2); fi\nA=\n'
                                       'if ! [ -n "$A" ]; then R+=(empty); fi\nset -- "${R[@]}"\n'),
    "a here-document and a quoted line are not commands": ('TP=2\ncat <<EOF >/dev/null\n  if you want FP8, set DTYPE\n'
                                                           '  TP=9\nEOF\necho "Note:\n  if the job fails" >/dev/null\n'
                                                           'set -- $TP\n'),
    "a value over several lines": 'P="\n    --tp 2 \\\n    --sp\n"\nset -- x $P\n',
    "arrays as words": 'A=("--a 1" --b)\nN="x  y"\nset -- "${A[*]}" "${A[@]}" ${A[@]} $N "$N"\n',
    "conditions joined by && and ||": ('A=1\nB=2\nR=()\nif [[ $A == 1 ]] && [[ $B == 3 ]]; then R+=(x); else R+=(y); fi\n'
                                       'if [[ $A == 2 ]] || [[ $B == 2 ]]; then R+=(z); fi\n'
                                       'if [ $A = 2 ]; then R+=(p)\nelif [ $A = 1 ] && \\\n   [ $B = 2 ]; then R+=(q); fi\n'
                                       'set -- "${R[@]}"\n'),
    "appending to values, elements and unset": ('X=--bf16\nX+=" --sp"\nY=--a\nY+=(--b)\nA=(--tp 2)\nA[1]=8\n'
                                                'U=--u\n[[ 1 == 1 ]] && unset U\nset -- $X "${Y[@]}" "${A[@]}" $U\n'),
    "a # inside a word, a brace group, a one-line case": (
        'A=(--name run#1 --bf16)\nM=fp8\n[[ $M == fp8 ]] && { P="--fp8-format hybrid"; }\n'
        'case $M in fp8) C=--c8 ;; bf16) C=--c16 ;; esac\nset -- "${A[@]}" $P $C x#y\n'),
    "quoted and unquoted parts of a pattern": ('M=llama3-8b\nR=()\n[[ $M == "llama3"* ]] && R+=(a)\n'
                                               '[[ $M == "llama3*" ]] && R+=(b)\nF=\nif [ -n $F ]; then R+=(c); fi\n'
                                               'set -- "${R[@]}"\n'),
    "arithmetic commands": 'G=64\n(( G *= 4 ))\nlet N=G/2\ni=1\n(( i++ ))\nset -- $G $N $i\n',
    "a here-document with an apostrophe, and a case over arms": (
        "TP=2\ncat <<'EOF' >/dev/null\nDon't edit: TP=9\nEOF\nMODEL=small\ncase $MODEL in\n  big|huge)\n"
        "    TP=8\n    ;;\n  small) TP=4 ;;\n  *) TP=1 ;;\nesac\nset -- $TP\n"),
}


@pytest.mark.parametrize("script", BASH_CASES.values(), ids=list(BASH_CASES))
def test_a_launch_script_expands_to_the_words_bash_runs(script):
    """Branches over the file's own values run as bash runs them, indented assignments in the branch
    taken included; tests, patterns and word splitting as bash evaluates them; here-documents and
    quoted text are not read as commands."""
    import subprocess

    from dsauto.engines.shell import expand_shell_variables, split_words

    bash = subprocess.run(["bash", "-c", script + 'printf "%s\\n" "$@"'], capture_output=True, text=True,
                          check=True).stdout.split("\n")[:-1]
    expanded = expand_shell_variables(script)
    assert split_words(expanded[expanded.rindex("set --"):])[2:] == bash


def test_the_command_ends_where_bash_ends_it_and_the_jobs_words_are_named(tmp_path):
    """A pipe or a redirection after the launch ends its flags; words the job fills ($EXTRA_ARGS, $@)
    are named, not read as values; a value a command computes ($(...)) is not the file's, and the
    value before it does not stand in for it."""
    script = tmp_path / "train.sh"
    body = MINIMAL.replace(" --data-path /data/x", "")
    script.write_text(f"torchrun --nproc_per_node 4 pretrain_gpt.py {body} --data-path /d/x $EXTRA_ARGS \"$@\" "
                      f"2>&1 | tee log.txt\n")
    launch = read_megatron_args(script)
    assert launch.pins["tp"] == 2 and launch.unknown == []
    assert (f"{script} passes on $EXTRA_ARGS, $@ from the job, which dsauto does not see; the plan is priced "
            f"without the flags they add.") in launch.notes
    script.write_text(f"TP=2\nTP=$(echo 8 | tr -d ' ')\ntorchrun pretrain_gpt.py {body.replace('--tensor-model-parallel-size 2', '--tensor-model-parallel-size $TP')}\n")
    with pytest.raises(DsautoError, match=r"gives --tensor-model-parallel-size '\$TP', not a whole number"):
        read_megatron_args(script)


def test_what_the_file_cannot_decide_sets_nothing_and_is_reported():
    """A branch over what the job sets, a file test, the arms of a case and a loop's body set nothing
    (reported with the outermost test that decides them), whatever they nest; a branch that does not
    run reads no default."""
    from dsauto.engines.megatron_args import expand_shell_variables

    script = ('TP=1\nif [ -f /etc/x ]; then\n  if [ 1 = 1 ]; then\n    A=1\n  else\n    B=2\n  fi\nfi\n'
              'case $SLURM_JOB_PARTITION in\n  big) TP=8;;\n  small)\n    TP=2\n    ;;\nesac\n'
              'for f in --sp --dist; do\n  ARGS+=($f)\ndone\n[ -d /tmp ] && C=3\n'
              'if [ 1 = 2 ]; then\n  X=${NEVER:-0}\nfi\nset -- $TP $A $C\n')
    unevaluated: dict[str, str] = {}
    defaults: dict[str, str] = {}
    expanded = expand_shell_variables(script, defaults, unevaluated)
    assert unevaluated == {"A": "[ -f /etc/x ]", "B": "[ -f /etc/x ]", "TP": "case $SLURM_JOB_PARTITION in",
                           "ARGS": "for f in --sp --dist", "C": "a list over a command's status"}
    assert shlex.split(expanded[expanded.rindex("set --"):])[2:] == ["1", "$A", "$C"] and defaults == {}


def test_the_launcher_sizes_the_plan_where_it_says_how_many_ranks_it_starts(tmp_path, capsys):
    """torchrun's --nnodes and --nproc-per-node (and the deepspeed launcher's --num_nodes and
    --num_gpus) give the world the command line leaves out; one that contradicts them is refused; a
    shell variable or an elastic range fixes nothing."""
    body = " pretrain_gpt.py " + MINIMAL.replace(" --data-path /data/x", "") + "\n"
    script = tmp_path / "train.sh"
    script.write_text("torchrun --nproc_per_node 8 --nnodes=2 --node_rank $NODE_RANK" + body)
    assert read_megatron_args(script).world == {"nodes": 2, "gpus_per_node": 8}
    assert main(["plan", "--megatron-args", str(script), "--hardware", "h100-80gb"]) == 0
    assert "on 2 x 8 h100-80gb (16 devices)" in capsys.readouterr().out
    assert main(["plan", "--megatron-args", str(script), "--hardware", "h100-80gb", "--nodes", "4"]) == 2
    assert "train.sh's launcher starts 2 nodes and the command line gives --nodes 4; drop one of them." in capsys.readouterr().err
    script.write_text("deepspeed --num_nodes 1 --num_gpus 4" + body)
    assert read_megatron_args(script).world == {"nodes": 1, "gpus_per_node": 4}
    script.write_text("torchrun --nproc-per-node $GPUS --nnodes 1:4" + body)
    launch = read_megatron_args(script)
    assert launch.world == {} and f"{script}'s launcher sets --nproc-per-node $GPUS, --nnodes 1:4, which fixes no size" \
        in launch.notes[0]
    # A size from a default the job may set (Megatron-LM's Mixtral script) is set as the job would set it
    # for the command line's size, and what the file computes from it follows.
    script.write_text("NNODES=${SLURM_NNODES:-1}\nGBS=$((4 * NNODES))\ntorchrun --nnodes $NNODES --nproc_per_node 8"
                      + body.replace("--global-batch-size 8", "--global-batch-size $GBS"))
    launch = read_megatron_args(script)
    assert launch.world == {"nodes": 1, "gpus_per_node": 8} and launch.train["global_batch"] == 4
    launch = read_megatron_args(script, sizes={"nodes": 2, "gpus_per_node": None})
    assert launch.world == {"nodes": 2, "gpus_per_node": 8} and launch.train["global_batch"] == 8
    assert (f"{script}'s launcher takes its size from what the job sets, and dsauto sets SLURM_NNODES=2 for the "
            f"command line's --nodes and --gpus-per-node, as the job would.") in launch.notes
    assert not any("leaves SLURM_NNODES" in note for note in launch.notes)
    capsys.readouterr()
    assert main(["plan", "--megatron-args", str(script), "--hardware", "h100-80gb", "--nodes", "2"]) == 0
    assert "on 2 x 8 h100-80gb (16 devices)" in capsys.readouterr().out
    # a size the file fixes, in both branches of a test over the job's size, still refuses another
    script.write_text("NNODES=${SLURM_NNODES:-1}\nif [ \"$NNODES\" -gt 1 ]; then\n  G=8\nelse\n  G=8\nfi\n"
                      "torchrun --nnodes $NNODES --nproc_per_node $G" + body)
    assert main(["plan", "--megatron-args", str(script), "--hardware", "h100-80gb", "--gpus-per-node", "4"]) == 2
    assert "launcher starts 8 ranks a node and the command line gives --gpus-per-node 4" in capsys.readouterr().err
    script.write_text("CKPT=${1:-ckpt}\ntorchrun --nproc_per_node 8" + body.rstrip() + " --save $CKPT\n")
    assert any("leaves $1 to the job and dsauto takes its default ($1=ckpt)" in note
               for note in read_megatron_args(script).notes)  # a positional argument's default


def test_errors_name_the_flags_the_launch_file_set(tmp_path, capsys):
    """A choice only the file fixed is named as the file spells it: the user changes it there."""
    script = tmp_path / "train.sh"
    base = MINIMAL.replace(" --data-path /data/x", "")
    script.write_text("torchrun --nproc_per_node 4 pretrain_gpt.py " + base.replace("--micro-batch-size 2", "--micro-batch-size 3")
                      + "\n")
    assert main(["plan", "--megatron-args", str(script), "--hardware", "cpu"]) == 2
    error = capsys.readouterr().err
    assert "change --micro-batch-size or --global-batch-size." in error and "--micro-batch " not in error
    script.write_text("torchrun --nproc_per_node 4 pretrain_gpt.py " + base + " --pipeline-model-parallel-layout 'Et|t*2L'\n")
    assert main(["plan", "--megatron-args", str(script), "--hardware", "cpu"]) == 2
    assert ("sets --pipeline-model-parallel-layout Et|t*2L, which places 3 transformer layers, and the model has 4; "
            "make them agree.") in capsys.readouterr().err
    # A mixture of experts at tp 2 without --sequence-parallel, which Megatron-core's MoE layer refuses:
    # named as what the file leaves out, not as a batch that does not divide
    experts = " --num-experts 4 --moe-router-topk 2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall"
    script.write_text("torchrun --nproc_per_node 4 pretrain_gpt.py " + base + experts + "\n")
    assert main(["plan", "--megatron-args", str(script), "--hardware", "cpu"]) == 2
    assert ("Sequence parallelism off (no --sequence-parallel) cannot run with --tensor-model-parallel-size 2: "
            "Megatron-core trains MoE layers under tensor parallelism only with sequence parallelism; turn it on"
            in capsys.readouterr().err)


def test_dsauto_s_own_file_reads_back_on_the_cluster_it_was_planned_for(tmp_path, capsys):
    """Its flags fix dp as the world size over the model-parallel degrees, so the file is priced on the
    nodes its first line names where the command line gives none, and refused where it gives others."""
    plan = make_plan("llama3-8b", "h100-80gb", nodes=2, gpus_per_node=8, global_batch=16, seq_len=8192,
                     engine="megatron", cp=2)
    path = write_megatron_args(plan, tmp_path / "megatron_args.txt")
    assert read_megatron_args(path).world == {"nodes": 2, "gpus_per_node": 8}
    assert f"data parallel {plan.dp} = world size 16 / (tp {plan.tp} x pp {plan.pp} x cp 2)" in path.read_text()
    assert main(["plan", "--megatron-args", str(path), "--hardware", "h100-80gb"]) == 0
    out = capsys.readouterr().out
    assert "on 2 x 8 h100-80gb (16 devices)" in out and f"step {format_seconds(plan.prediction.step_seconds)}," in out
    assert main(["plan", "--megatron-args", str(path), "--hardware", "h100-80gb", "--nodes", "4", "--gpus-per-node",
                 "4"]) == 0  # the same world, shaped otherwise
    assert "on 4 x 4 h100-80gb (16 devices)" in capsys.readouterr().out
    assert main(["plan", "--megatron-args", str(path), "--hardware", "h100-80gb", "--nodes", "1"]) == 2
    assert (f"{path} was planned for 2 x 8 ranks, whose world size its data-parallel degree follows, and the "
            f"command line makes 1 x 8; give --nodes and --gpus-per-node making 16 ranks, or leave them out."
            in capsys.readouterr().err)
    # only its first line says so, and not in a script whose launcher sizes the world
    from dsauto.engines.megatron_args import planned_world

    header = path.read_text().partition("\n")[0]
    assert planned_world(header.replace("h100-80gb", "my h100 box") + "\n--num-layers 2") == {"nodes": 2,
                                                                                           "gpus_per_node": 8}
    assert planned_world("--num-layers 2\n" + header) == {}
    assert planned_world(f"#!/bin/bash\n# my note\n\n{header}\r\n--num-layers 2") == {"nodes": 2, "gpus_per_node": 8}
    script = tmp_path / "train.sh"
    script.write_text(f"{header}\ntorchrun --nnodes $NNODES pretrain_gpt.py {MINIMAL}\n")
    assert read_megatron_args(script).world == {}
    # and on the hardware it names, where the command line gives none
    assert read_megatron_args(path).hardware == "h100-80gb"
    assert main(["plan", "--megatron-args", str(path)]) == 0
    assert "on 2 x 8 h100-80gb (16 devices)" in capsys.readouterr().out
    path.write_text(path.read_text().replace("h100-80gb.", "my-cluster.", 1))
    assert main(["plan", "--megatron-args", str(path)]) == 2
    assert (f"{path} was planned on my-cluster, which is not a hardware preset; give --hardware with the cluster "
            f"YAML it was planned on." in capsys.readouterr().err)


def test_rotary_positions_beyond_the_model_s_are_sized_to_the_sequence(tmp_path):
    """Megatron-LM's validate_args asserts --max-position-embeddings >= --seq-length: a plan that
    extends a rotary model's context writes the sequence's length, and a launch that gives fewer
    positions than its sequence is refused."""
    with pytest.warns(DsautoWarning, match="extends its context"):
        plan = make_plan("llama3-8b", "h100-80gb", nodes=1, gpus_per_node=8, global_batch=8, seq_len=16384)
    lines = megatron_args(plan)
    assert "--max-position-embeddings 16384" in lines and "--seq-length 16384" in lines
    assert "--max-position-embeddings 8192" in megatron_args(
        make_plan("llama3-8b", "h100-80gb", nodes=1, gpus_per_node=8, global_batch=8, seq_len=4096))
    with pytest.raises(DsautoError, match="launch.sh gives --max-position-embeddings 128 below --seq-length 256, "
                                          "which Megatron-LM's validate_args refuses; give --max-position-embeddings "
                                          "256 or more."):
        parse_megatron_args(MINIMAL.split() + ["--max-position-embeddings", "128"], "launch.sh")


def test_values_a_shell_would_read_otherwise_are_quoted_and_read_back(tmp_path):
    """A pipeline layout's | and * (and an expert pattern's parentheses) are quoted, a comment says how
    to pass the words, bash's reading of them is the plugin's argv, and the reader takes them back."""
    import subprocess

    plan = make_plan("llama3-8b", "h100-80gb", nodes=1, gpus_per_node=8, global_batch=32, seq_len=4096,
                     engine="megatron", pp=4, vpp=2, stage_layers="9,8,8,7")
    path = write_megatron_args(plan, tmp_path / "llama 8b.args")  # the comment names the file written
    text = path.read_text()
    [layout] = [line for line in text.splitlines() if line.startswith("--pipeline-model-parallel-layout")]
    assert layout.split(" ", 1)[1].startswith("'") and "|" in layout
    hint = "eval \"ARGS=($(grep -v '^#' 'llama 8b.args'))\""
    assert hint in text
    read = subprocess.run(["bash", "-c", hint + "; printf '%s\\n' \"${ARGS[@]}\""],
                          cwd=tmp_path, capture_output=True, text=True, check=True).stdout.splitlines()
    from dsauto.emit.megatron import megatron_argv

    assert read == megatron_argv(plan)
    assert read[read.index("--pipeline-model-parallel-layout") + 1] == layout.split(" ", 1)[1].strip("'")
    launch = read_megatron_args(path)
    assert launch.pins["stage_layers"] in ((9, 8, 8, 7), "9,8,8,7")


def test_multi_token_prediction_layers_read_back_and_a_named_model_trains_the_launchs(tmp_path):
    """dsauto's file launches a model's multi-token-prediction layer (--mtp-num-layers, and an m before
    the loss in a layout string) and reads back into the same plan, named or not; a named model takes
    the launch's layers (a DeepSeek-V3 launch without --mtp-num-layers trains none), said in a note;
    a layout whose m's disagree with the flag is refused, as Megatron asserts."""
    model = dataclasses.replace(load_model("llama3-8b"), mtp_layers=1)
    plan = make_plan(model, "h100-80gb", nodes=2, global_batch=64, seq_len=4096, engine="megatron", pp=4, vpp=1,
                     stage_layers=(8, 8, 9, 7))
    path = write_megatron_args(plan, tmp_path / "megatron_args.txt")
    text = path.read_text()
    assert "--mtp-num-layers 1\n" in text and "--pipeline-model-parallel-layout 'Et*8|t*8|t*9|t*7mL'" in text
    launch = read_megatron_args(path, plan.model)
    assert launch.unknown == [] and launch.notes == [] and launch.model == plan.model
    [again] = find_plans(make_problem(launch.model, "h100-80gb", nodes=2, **launch.train, **launch.pins))
    assert dataclasses.replace(again, ranking=None) == dataclasses.replace(plan, ranking=None)
    assert read_megatron_args(path).model.mtp_layers == 1  # the flags describe it too
    path.write_text(text.replace("--mtp-num-layers 1\n", ""))
    with pytest.raises(DsautoError, match="places 1 multi-token-prediction layer.s., and it sets "
                                          "no --mtp-num-layers; make them agree"):
        read_megatron_args(path, plan.model)
    path.write_text(text.replace("--mtp-num-layers 1\n", "").replace("t*7mL", "t*7L"))
    launch = read_megatron_args(path, plan.model)
    assert launch.model == dataclasses.replace(plan.model, mtp_layers=0)
    assert launch.notes == [f"{path} sets no --mtp-num-layers, and --model {model.name} has 1 "
                            f"multi-token-prediction layer(s): the plan trains 0, as the launch does."]


@pytest.mark.parametrize("layout", ["Et|(tt|)*30mL", "Et*4|(t*4|)*14tmL", "Ettt|(tt|)*29,m|L", "E|t*4L",
                                    "Et*2||t|tL", "(Et|)*1,(tt|)*2,t*3L"])
def test_layout_strings_unroll_as_megatron_core_reads_them(layout):
    """NVIDIA's DeepSeek-V3 recipes write layouts with repeated groups and commas (Megatron-Bridge's
    perf_recipes/deepseek: "Et|(tt|)*30mL" on H100, "Et*4|(t*4|)*14tmL" on GB300); dsauto unrolls them
    to the chunks Megatron-core's own parser builds."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    letters = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}
    parsed = PipelineParallelLayerLayout.parse_str_to_list(layout)
    assert expand_layout(layout, "the layout").split("|") == [
        "".join(letters[layer.name] for layer in chunk) for chunk in parsed]


def test_nvidias_deepseek_v3_layouts_read_or_are_refused_in_one_sentence():
    """GB300's layout (pp 16: 4 layers on the first stage, 4 on the next 14, 1 and the prediction layer
    with the loss on the last) reads as those stages; H100's interleaved one splits a rank's layers
    unevenly over its two chunks (rank 0: 1 and 2, rank 15: 2 and none beside the loss) and reads
    chunk by chunk; a standalone prediction chunk puts the layer apart from the loss, which is not
    priced, and the refusal says so."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DsautoWarning)
        model = load_model(str(CONFIGS / "deepseek-v3.json"))
    flags = ("--multi-latent-attention --seq-length 4096 --micro-batch-size 1 --global-batch-size 8192 "
             "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 16 --expert-model-parallel-size 64 "
             "--moe-token-dispatcher-type alltoall --mtp-num-layers 1 --bf16 ")
    launch = parse_megatron_args(shlex.split(flags + "--pipeline-model-parallel-layout 'Et*4|(t*4|)*14tmL'"),
                                 "train.sh", model)
    assert launch.pins["stage_layers"] == (4,) * 15 + (1,) and launch.pins["vpp"] == 1
    assert launch.model.mtp_layers == 1
    h100 = parse_megatron_args(shlex.split(flags + "--pipeline-model-parallel-layout 'Et|(tt|)*30mL'"), "train.sh",
                               model)
    assert h100.pins["stage_layers"] == (1,) + (2,) * 30 + (0,) and h100.pins["vpp"] == 2
    with pytest.raises(DsautoError, match="sets --pipeline-model-parallel-layout with --decoder-first-pipeline-num-layers, "
                                          "which Megatron-LM refuses beside a layout; keep the layout alone"):
        parse_megatron_args(shlex.split(flags + "--pipeline-model-parallel-layout 'Et*4|(t*4|)*14tmL' "
                                                "--decoder-first-pipeline-num-layers 4"), "train.sh", model)
    with pytest.raises(DsautoError, match="dsauto prices the embedding .E. first, the loss .L. at the end of the last "
                                          "chunk and the multi-token-prediction layers .m. just before it"):
        parse_megatron_args(shlex.split(flags + "--pipeline-model-parallel-layout 'Et*3|(t*4|)*14,m|L'"),
                            "train.sh", model)


def test_a_nested_layout_group_megatron_core_does_not_read_is_refused():
    with pytest.raises(DsautoError, match=r"which dsauto does not read: it knows E, t, m, L"):
        expand_layout("E((t|)*2t)*2L", "train.sh")


@pytest.mark.parametrize("layout", ["E t|tL", "()*3Et|tL", "E(t|(t|)*2)*2L", "t*-1"])
def test_layouts_megatron_core_refuses_are_refused(layout):
    with pytest.raises(DsautoError, match=r"which dsauto does not read: it knows E, t, m, L"):
        expand_layout(layout, "train.sh")


def test_a_layout_that_repeats_past_any_real_one_is_refused_at_once():
    with pytest.raises(DsautoError, match="which repeats past 1,000,000 characters"):
        expand_layout("E" + "t*900000" * 5 + "L", "train.sh")
    with pytest.raises(DsautoError, match="which repeats past 1,000,000 characters"):
        expand_layout("E(t|)*999999999L", "train.sh")


def test_mtp_num_layers_0_is_megatrons_none():
    launch = parse_megatron_args(shlex.split(MINIMAL + " --mtp-num-layers 0"), "train.sh")
    assert launch.model.mtp_layers == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DsautoWarning)
        model = load_model(str(CONFIGS / "deepseek-v3.json"))
    flags = ("--multi-latent-attention --seq-length 4096 --micro-batch-size 1 --global-batch-size 8192 "
             "--moe-token-dispatcher-type alltoall --mtp-num-layers 0 --bf16")
    launch = parse_megatron_args(shlex.split(flags), "train.sh", model)
    assert launch.model.mtp_layers == 0
    assert launch.notes[0].startswith("train.sh sets --mtp-num-layers 0, and --model deepseek-ai/DeepSeek-V3 has 1 ")


def test_a_launch_whose_layers_megatron_cannot_split_evenly_says_so():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DsautoWarning)
        model = load_model(str(CONFIGS / "deepseek-v3.json"))
    flags = ("--multi-latent-attention --seq-length 4096 --micro-batch-size 1 --global-batch-size 8192 "
             "--moe-token-dispatcher-type alltoall --mtp-num-layers 1 --bf16 --pipeline-model-parallel-size 16")
    with pytest.raises(DsautoError, match="sets --pipeline-model-parallel-size 16 and no layout flag, so Megatron-core "
                                          "splits the 61 transformer layers evenly, which 16 stages cannot"):
        parse_megatron_args(shlex.split(flags), "train.sh", model)
