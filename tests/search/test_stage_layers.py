"""--stage-layers pins the pipeline layout: Megatron-core's even split ('even'), or one count per
stage. The search prices and bounds memory with that layout alone, the emitted flags place the
layers so, and a layout that cannot run is refused in one sentence."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from dsauto.api import find_plans, make_plan, make_problem
from dsauto.cli import main
from dsauto.emit.megatron import megatron_args
from dsauto.engines.megatron_args import parse_megatron_args
from dsauto.errors import DsautoError
from dsauto.plan import accounted_chunks, block_recompute_set
from dsauto.plan_io import read_plan
from dsauto.refine.space import options_of, strategy_of
from dsauto.search.planner import Planner
from dsauto.spec.loaders import load_model

# Llama 3 70B (80 layers) on 64 H100s: tp 4 x pp 4, where the search balances the stages unevenly
# (the head makes the last stage slower, the embedding the first one lighter).
PINS = dict(nodes=8, global_batch=128, seq_len=8192, tp=4, pp=4, engine="megatron")


def layout_flags(plan) -> list[str]:
    """The layout lines as Megatron-LM reads them (the file quotes the layout's | and *)."""
    return [" ".join(shlex.split(line)) for line in megatron_args(plan)
            if line.startswith(("--pipeline-model-parallel-layout", "--decoder-first", "--decoder-last"))]


def test_even_is_megatron_cores_default_split_and_needs_no_layout_flag():
    balanced = make_plan("llama3-70b", "h100-80gb", **PINS, vpp=1)  # one chunk a rank: no layout string
    even = make_plan("llama3-70b", "h100-80gb", **PINS, vpp=1, stage_layers="even")
    assert balanced.stage_layers != (20, 20, 20, 20) and layout_flags(balanced)
    assert even.stage_layers == (20, 20, 20, 20) and not layout_flags(even)
    # The balanced layouts include the even one, so the even split is not predicted faster; memory is
    # bounded with the even split itself.
    assert fastest(even) >= fastest(balanced) * (1 - 1e-9)
    assert even.prediction.peak_memory_bytes <= even.memory_budget_bytes


def test_even_under_interleaving_splits_every_model_chunk_alike():
    plan = make_plan("llama3-70b", "h100-80gb", **PINS, vpp=4, stage_layers="even")
    assert plan.virtual_stages == 4 and plan.stage_layers == (20, 20, 20, 20)
    # 5 layers in each of the 16 model chunks, as Megatron-core splits them (the layout string also
    # carries the virtual stages)
    assert layout_flags(plan) == ["--pipeline-model-parallel-layout Et*5|" + "t*5|" * 14 + "t*5L"]


def test_a_pinned_layout_may_leave_model_chunks_empty():
    """Interleaving with fewer layers than chunks on the end stages (Zero Bubble's 1F1B-I baselines:
    one layer a chunk, the first and last stages one layer short): the layout string gives those
    chunks no layer, and the fill and drain still shrink against one chunk a rank."""
    pins = dict(nodes=1, global_batch=64, seq_len=2048, tp=1, pp=8, engine="megatron", micro_batch=1)
    layout = "3,4,4,4,4,4,4,5"  # llama3-8b's 32 layers, 4 chunks a rank: the first rank's last chunk empty
    padded = make_plan("llama3-8b", "a100-80gb", **pins, vpp=4, stage_layers=layout)
    plain = make_plan("llama3-8b", "a100-80gb", **pins, vpp=1, stage_layers=layout)
    assert padded.virtual_stages == 4 and padded.stage_layers == (3, 4, 4, 4, 4, 4, 4, 5)
    # chunk s * pp + r is rank r's s-th; a rank's earlier chunks take its remainder
    chunks = ["Et"] + ["t"] * 6 + ["t*2"] + ["t"] * 16 + [""] + ["t"] * 6 + ["tL"]
    assert layout_flags(padded) == ["--pipeline-model-parallel-layout " + "|".join(chunks)]
    assert padded.prediction.bubble_seconds < plain.prediction.bubble_seconds / 2
    # Past one layer a chunk, more chunks no longer shorten the fill and drain (each rank's first
    # chunk holds a layer), while the boundaries to cross multiply.
    more = make_plan("llama3-8b", "a100-80gb", **pins, vpp=8, stage_layers=layout)
    assert more.prediction.bubble_seconds >= padded.prediction.bubble_seconds
    assert more.prediction.step_seconds > padded.prediction.step_seconds
    with pytest.raises(DsautoError, match="--vpp 5 cannot run on the layouts the search tries: they give each "
                                          "model chunk a layer, and 32 layers over pp 8 leave 4 a stage; pin "
                                          "--stage-layers"):
        make_plan("llama3-8b", "a100-80gb", **pins, vpp=5)


def test_a_layout_given_chunk_by_chunk_is_priced_emitted_and_read_back_as_given(tmp_path):
    """pp x vpp counts pin each model chunk (chunk s * pp + r is rank r's s-th), as Megatron-core's layout
    string does: rank 0's 8 layers split 1 + 7, the others' 4 + 4. The plan keeps the chunks, prices
    each rank's own (its first chunk of one layer fills the pipeline sooner, its second of seven holds
    the others up: a longer bubble than the even split's), launches them as a layout string, writes and
    reads them in plan.yaml, and dsauto reads its own launch back to the same pins."""
    pins = dict(nodes=1, global_batch=64, seq_len=2048, tp=1, pp=4, engine="megatron", micro_batch=1)
    chunked = make_plan("llama3-8b", "a100-80gb", **pins, vpp=2, stage_layers="1,4,4,4,7,4,4,4")
    even = make_plan("llama3-8b", "a100-80gb", **pins, vpp=2, stage_layers="8,8,8,8")
    assert chunked.stage_layers == even.stage_layers == (8, 8, 8, 8)
    assert chunked.chunk_layout == (1, 4, 4, 4, 7, 4, 4, 4) and even.chunk_layout is None
    assert [len(r) for r in chunked.stage_ranges()] == list(chunked.chunk_layout)
    assert chunked.prediction.bubble_seconds > even.prediction.bubble_seconds
    assert layout_flags(chunked) == ["--pipeline-model-parallel-layout Et|t*4|t*4|t*4|t*7|t*4|t*4|t*4L"]
    # the same counts given evenly are the even split, without a chunk layout
    assert make_plan("llama3-8b", "a100-80gb", **pins, vpp=2, stage_layers="4,4,4,4,4,4,4,4").chunk_layout is None
    problem = make_problem("llama3-8b", "a100-80gb", **pins, vpp=2, stage_layers="1,4,4,4,7,4,4,4")
    rebuilt = Planner(problem.model, problem.cluster, problem.train, problem.pins).build_plan(
        strategy_of(chunked), chunked.stage_layers, options_of(chunked))
    assert rebuilt.prediction.step_seconds == pytest.approx(chunked.prediction.step_seconds)
    assert main(["tune", "--model", "llama3-8b", "--hardware", "a100-80gb", "--nodes", "1", "--global-batch", "64",
                 "--seq-len", "2048", "--tp", "1", "--pp", "4", "--vpp", "2", "--engine", "megatron",
                 "--micro-batch", "1", "--stage-layers", "1,4,4,4,7,4,4,4", "--out", str(tmp_path)]) == 0
    written = read_plan(tmp_path / "plan.yaml")
    assert written.chunk_layout == chunked.chunk_layout
    assert main(["plan", "--megatron-args", str(tmp_path / "megatron_args.txt"), "--model", "llama3-8b"]) == 0


def test_counts_are_read_chunk_by_chunk_only_with_pp_and_vpp_pinned():
    """Without --pp, 8 counts are 8 stages (each split evenly over its chunks), never 4 ranks' chunks: one
    reading of the flag, whatever the search tries; --recompute-num-layers then checkpoints as usual."""
    pins = dict(nodes=1, global_batch=64, seq_len=2048, tp=1, engine="megatron", micro_batch=1)
    plan = make_plan("llama3-8b", "a100-80gb", **pins, vpp=2, stage_layers="1,4,4,4,7,4,4,4")
    assert plan.pp == 8 and plan.chunk_layout is None and plan.stage_layers == (1, 4, 4, 4, 7, 4, 4, 4)
    searched = make_plan("llama3-8b", "a100-80gb", **pins, stage_layers="1,4,4,4,7,4,4,4", recompute_num_layers=2)
    assert searched.pp == 8 and searched.chunk_layout is None


def test_a_layout_given_chunk_by_chunk_checkpoints_the_first_n_layers_of_every_chunk():
    """Megatron-core checkpoints the first N layers of every chunk: over chunks of 1 to 7 layers N = 2
    checkpoints 1 + 2 of rank 0's chunks and 2 + 2 of the others', which the plan, its prediction and
    its launch follow; every layer is N = 7, the largest chunk."""
    pins = dict(nodes=1, global_batch=64, seq_len=2048, tp=1, pp=4, engine="megatron", micro_batch=1, vpp=2,
                stage_layers="1,4,4,4,7,4,4,4")
    every = make_plan("llama3-8b", "a100-80gb", **pins, checkpoint=True)
    assert len(every.checkpointed_layers()) == 32
    assert [line for line in megatron_args(every) if line.startswith("--recompute-num-layers")] == [
        "--recompute-num-layers 7"]
    assert make_plan("llama3-8b", "a100-80gb", **pins, recompute_num_layers=7).checkpointed_layers() == \
        every.checkpointed_layers()
    two = make_plan("llama3-8b", "a100-80gb", **pins, recompute_num_layers=2)
    assert set(two.checkpointed_layers()) == set(block_recompute_set(two.stage_layers, 2, 2, two.chunk_layout))
    assert [sum(1 for j in held if j in two.checkpointed_layers()) for held in two.rank_layers()] == [3, 4, 4, 4]
    assert [line for line in megatron_args(two) if line.startswith("--recompute-num-layers")] == [
        "--recompute-num-layers 2"]
    # the search tries every N and keeps the fastest that fits
    assert every.prediction.step_seconds > two.prediction.step_seconds


def test_a_pinned_layout_is_priced_as_the_planner_prices_that_layout():
    """Pinning the layout the search chose reproduces its plan; pinning another prices that one with
    the same per-layer search, and build_plan of the result agrees with its prediction."""
    problem = make_problem("llama3-70b", "h100-80gb", **PINS)
    chosen = find_plans(problem)[0]
    again = make_plan("llama3-70b", "h100-80gb", **PINS, vpp=chosen.virtual_stages,
                      stage_layers=chosen.stage_layers)
    assert again.stage_layers == chosen.stage_layers
    assert again.prediction.step_seconds == pytest.approx(chosen.prediction.step_seconds)

    pinned = make_plan("llama3-70b", "h100-80gb", **PINS, vpp=1, stage_layers="18,21,21,20")
    assert pinned.stage_layers == (18, 21, 21, 20)
    rebuilt = Planner(problem.model, problem.cluster, problem.train, problem.pins).build_plan(
        strategy_of(pinned), pinned.stage_layers, options_of(pinned))
    assert rebuilt.prediction.step_seconds == pytest.approx(pinned.prediction.step_seconds)
    assert rebuilt.prediction.peak_memory_bytes == pytest.approx(pinned.prediction.peak_memory_bytes)
    assert layout_flags(pinned) == ["--decoder-first-pipeline-num-layers 18", "--decoder-last-pipeline-num-layers 20"]


def test_an_uneven_pipeline_is_still_searched_without_the_pin():
    plan = make_plan("llama3-70b", "h100-80gb", nodes=6, global_batch=128, seq_len=8192, tp=8, pp=3,
                     engine="megatron")
    assert sum(plan.stage_layers) == 80 and len(set(plan.stage_layers)) == 2


def test_the_pin_leaves_the_pipeline_degree_to_the_search_where_it_names_none():
    plan = make_plan("gpt-tiny", "cpu", nodes=1, gpus_per_node=4, engine="deepspeed", stage_layers="1,3")
    assert plan.pp == 2 and plan.stage_layers == (1, 3)


EIGHT_NODES = ["--nodes", "8", "--tp", "4", "--global-batch", "128"]
SIX_NODES = ["--nodes", "6", "--tp", "8", "--global-batch", "96"]


@pytest.mark.parametrize("argv, said", [
    ([*EIGHT_NODES, "--stage-layers", "x,2"], "--stage-layers x,2: give 'even' or one whole number of transformer "
                                              "layers per pipeline stage"),
    ([*EIGHT_NODES, "--stage-layers", "10,10"], "--stage-layers 10,10 places 20 transformer layers and the model has "
                                                "80; give counts that add up to 80, or 'even'."),
    ([*EIGHT_NODES, "--stage-layers", "0,80"], "every pipeline stage needs at least one transformer layer"),
    ([*EIGHT_NODES, "--pp", "8", "--stage-layers", "20,20,20,20"], "--stage-layers 20,20,20,20 cannot run: it names "
                                                                   "4 stages and the plan has pp 8"),
    ([*SIX_NODES, "--pp", "3", "--stage-layers", "even"], "--stage-layers even cannot run: 80 transformer layers do "
                                                          "not split evenly over pp 3 model chunks"),
    ([*EIGHT_NODES, "--pp", "4", "--vpp", "3", "--stage-layers", "even"], "80 transformer layers do not split evenly "
                                                                          "over pp 4 x vpp 3 = 12 model chunks"),
])
def test_layouts_that_cannot_run_are_one_sentence_exit_2_and_no_files(tmp_path, capsys, argv, said):
    code = main(["tune", "--model", "llama3-70b", "--hardware", "h100-80gb", "--seq-len", "4096",
                 "--engine", "megatron", *argv, "--out", str(tmp_path)])
    error = capsys.readouterr().err.strip()
    assert code == 2, error
    assert len(error.splitlines()) == 1 and said in error
    assert not list(tmp_path.iterdir())


def test_the_pin_reaches_plan_yaml(tmp_path):
    assert main(["tune", "--model", "gpt-tiny", "--gpus-per-node", "4", "--pp", "2", "--engine", "deepspeed",
                 "--stage-layers", "3,1", "--out", str(tmp_path)]) == 0
    assert read_plan(tmp_path / "plan.yaml").stage_layers == (3, 1)


def test_api_takes_the_counts_as_a_sequence():
    with pytest.raises(DsautoError, match="places 5 transformer layers and the model has 4"):
        make_plan("gpt-tiny", "cpu", gpus_per_node=4, pp=2, stage_layers=(2, 3))


def fastest(plan) -> float:
    """The fastest step the search found (the winner may trade a near-tie for memory headroom)."""
    return plan.ranking.fastest_step_seconds if plan.ranking else plan.prediction.step_seconds


@pytest.mark.parametrize("model, pp, vpp", [("gpt-tiny", 2, 1), ("llama3-8b", 2, 2), ("llama3-8b", 4, 1)])
def test_no_pinned_layout_beats_the_balanced_search(model, pp, vpp):
    """Layouts pinned one at a time (any first stage, the rest even): none is predicted faster than
    the fastest plan of the search that balances the stages itself."""
    hardware, nodes = ("cpu", {"gpus_per_node": 4}) if model == "gpt-tiny" else ("h100-80gb", {"nodes": 2})
    pins = dict(pp=pp, vpp=vpp, engine="megatron", global_batch=16, micro_batch=1, zero_stage=1, **nodes)
    balanced = make_plan(model, hardware, **pins)
    num_layers = balanced.model.num_layers
    tried = 0
    for first in range(vpp, num_layers - (pp - 1) * vpp + 1):
        rest = num_layers - first
        middle = rest // (pp - 1)
        if rest % (pp - 1) or middle < vpp or first % vpp or middle % vpp:
            continue
        layout = (first, *(middle,) * (pp - 1))
        pinned = make_plan(model, hardware, **pins, stage_layers=layout)
        tried += 1
        assert pinned.stage_layers == layout
        assert fastest(pinned) >= fastest(balanced) * (1 - 1e-9)
    assert tried >= 2


@pytest.mark.parametrize("layers, pp, vpp, embedding, loss", [
    (30, 4, 2, True, True), (94, 32, 3, True, True), (15, 4, 1, True, False), (14, 5, 1, False, True),
    (62, 8, 4, True, True)])
def test_the_split_counting_the_embedding_and_loss_is_megatron_cores(layers, pp, vpp, embedding, loss):
    """Megatron-LM's --account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split,
    chunk by chunk as Megatron-core's own get_num_layers_to_build builds them."""
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=layers, hidden_size=64, num_attention_heads=4,
                               pipeline_model_parallel_size=pp, pipeline_dtype=torch.bfloat16,
                               virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                               account_for_embedding_in_pipeline_split=embedding,
                               account_for_loss_in_pipeline_split=loss)
    built = [get_num_layers_to_build(config, vp_stage=stage if vpp > 1 else None, pp_rank=rank)
             for stage in range(vpp) for rank in range(pp)]
    assert accounted_chunks(layers, pp, vpp, embedding, loss) == built


def test_even_with_the_embedding_and_loss_counted_is_priced_emitted_and_read_back(tmp_path):
    """--stage-layers even+embedding+loss: 30 layers + 2 over pp 4 x vpp 2 chunks of 4, the first and the
    last one layer short; launched as a layout string, and Megatron-LM's own flags for it read back to
    the same plan."""
    model = dataclasses.replace(load_model("llama3-8b"), num_layers=30)
    pins = dict(nodes=1, global_batch=64, seq_len=2048, tp=1, pp=4, vpp=2, engine="megatron", micro_batch=1)
    plan = make_plan(model, "a100-80gb", **pins, stage_layers="even+embedding+loss")
    assert plan.chunk_layout == (3, 4, 4, 4, 4, 4, 4, 3) and plan.stage_layers == (7, 8, 8, 7)
    assert layout_flags(plan) == ["--pipeline-model-parallel-layout Et*3|t*4|t*4|t*4|t*4|t*4|t*4|t*3L"]
    flags = [line for line in megatron_args(plan) if not line.startswith(("#", "--pipeline-model-parallel-layout"))]
    flags += ["--num-virtual-stages-per-pipeline-rank 2", "--account-for-embedding-in-pipeline-split",
              "--account-for-loss-in-pipeline-split"]
    launch = parse_megatron_args(shlex.split(" ".join(flags)), "train.sh", model)
    assert launch.pins["stage_layers"] == "even+embedding+loss" and launch.pins["vpp"] == 2
    assert make_plan(model, "a100-80gb", **{**pins, **launch.pins}).chunk_layout == plan.chunk_layout
    # Megatron-LM counts them with the layers in --num-layers-per-virtual-pipeline-stage: 32 / 4 / 4 = 2 chunks
    per_chunk = [f.replace("--num-virtual-stages-per-pipeline-rank 2", "--num-layers-per-virtual-pipeline-stage 4")
                 for f in flags]
    assert parse_megatron_args(shlex.split(" ".join(per_chunk)), "train.sh", model).pins["vpp"] == 2
    with pytest.raises(DsautoError, match="which Megatron-core refuses beside it; keep one way"):
        parse_megatron_args(shlex.split(" ".join(flags) + " --decoder-first-pipeline-num-layers 7"), "train.sh",
                            model)
    with pytest.raises(DsautoError, match=r"splits 30 transformer layers \+ the loss = 31 evenly over pp 4 x vpp 2 "
                                          r"= 8 model chunks, which Megatron-core refuses"):
        make_plan(model, "a100-80gb", **pins, stage_layers="even+loss")
    with pytest.raises(DsautoError, match="pin --pp"):
        make_plan(model, "a100-80gb", **{**pins, "pp": None, "vpp": None}, stage_layers="even+loss")
    # without --vpp, Megatron-core's split of one chunk a rank: 32 / 4 stages, the first and the last 7
    assert make_plan(model, "a100-80gb", **{**pins, "vpp": None}, stage_layers="even+embedding+loss").stage_layers \
        == (7, 8, 8, 7)


def test_a_vpp_too_deep_for_the_searched_layouts_names_the_accounted_split(capsys, tmp_path):
    model = tmp_path / "m.yaml"
    model.write_text("name: l14\narchitecture: decoder\nnum_layers: 14\nhidden_size: 256\nnum_attention_heads: 4\n"
                     "ffn_hidden_size: 1024\nvocab_size: 1024\nmax_position_embeddings: 2048\nmlp: gelu\n"
                     "norm: layernorm\nposition_embedding: learned\ntied_embeddings: false\nlinear_bias: true\n"
                     "dropout: false\n")
    argv = ["tune", "--model", str(model), "--hardware", "h100-80gb", "--gpus-per-node", "8", "--global-batch", "16",
            "--engine", "megatron", "--pp", "8", "--vpp", "2", "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    assert "pin --stage-layers even+embedding+loss (Megatron-core's even split counting the embedding and the loss" \
        in capsys.readouterr().err
    assert main([*argv, "--stage-layers", "even+embedding+loss"]) == 0
    assert read_plan(tmp_path / "out" / "plan.yaml").chunk_layout == (0,) + (1,) * 14 + (0,)
