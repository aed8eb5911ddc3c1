"""Megatron-core options an expert pins: --tp-comm-overlap and --grad-reduce-in-bf16 are priced,
recorded in the plan, emitted as Megatron-LM's flags, and refused in one sentence where they cannot run."""

from __future__ import annotations

import dataclasses

import pytest

from dsauto.api import make_plan
from dsauto.cli import main
from dsauto.emit.megatron import megatron_args
from dsauto.plan_io import read_plan
from dsauto.refine.space import strategy_of

PINS = dict(engine="megatron", tp=2, pp=1, zero_stage=1, micro_batch=1, checkpoint=False)


def flags(plan) -> dict[str, str | None]:
    return {line.partition(" ")[0]: line.partition(" ")[2] or None
            for line in megatron_args(plan) if not line.startswith("# ")}


def test_tp_comm_overlap_hides_the_tensor_parallel_collectives():
    plain = make_plan("llama3-8b", "h100-80gb", **PINS)
    overlapped = make_plan("llama3-8b", "h100-80gb", tp_comm_overlap=True, **PINS)
    assert not plain.tp_comm_overlap and overlapped.tp_comm_overlap
    assert "--tp-comm-overlap" in flags(overlapped) and "--tp-comm-overlap" not in flags(plain)
    assert strategy_of(overlapped).tp_comm_overlap
    assert overlapped.layers == plain.layers
    assert overlapped.prediction.step_seconds < plain.prediction.step_seconds
    assert overlapped.prediction.peak_memory_bytes == plain.prediction.peak_memory_bytes


def test_tp_comm_overlap_without_tensor_parallelism_is_off_and_said(recwarn):
    plan = make_plan("llama3-8b", "h100-80gb", **{**PINS, "tp": 1}, tp_comm_overlap=True)
    assert not plan.tp_comm_overlap and "--tp-comm-overlap" not in flags(plan)
    assert any("takes effect with tp > 1" in str(w.message) for w in recwarn)


def test_bf16_gradients_halve_the_gradient_buffer_and_its_bucket():
    fp32 = make_plan("llama3-8b", "h100-80gb", **PINS)
    bf16 = make_plan("llama3-8b", "h100-80gb", grad_reduce_in_fp32=False, **PINS)
    assert fp32.grad_reduce_in_fp32 and not bf16.grad_reduce_in_fp32
    assert strategy_of(bf16).grad_reduce_in_fp32 is False
    assert "--grad-reduce-in-bf16" in flags(bf16) and "--grad-reduce-in-bf16" not in flags(fp32)
    for stage_bf16, stage_fp32 in zip(bf16.stages, fp32.stages):
        assert stage_bf16.grads_bytes == pytest.approx(stage_fp32.grads_bytes / 2)
    assert bf16.prediction.peak_memory_bytes < fp32.prediction.peak_memory_bytes
    # --ddp-bucket-size counts parameters: bf16 gradients fill a bucket of the same bytes with twice as many.
    assert int(flags(bf16)["--ddp-bucket-size"]) == bf16.reduce_bucket_bytes // 2
    assert int(flags(fp32)["--ddp-bucket-size"]) == fp32.reduce_bucket_bytes // 4


@pytest.mark.parametrize("argv, said", [
    (["--tp-comm-overlap", "--engine", "deepspeed"], "--tp-comm-overlap cannot run: the tensor-parallel overlap "
                                                     "is Megatron-core's"),
    (["--grad-reduce-in-bf16", "--engine", "deepspeed"], "--grad-reduce-in-bf16 cannot run: bf16 gradient buffers"),
    (["--grad-reduce-in-bf16", "--dtype", "fp16"], "bf16 gradients apply to bf16 training, not fp16; leave it out."),
])
def test_options_that_cannot_run_are_one_sentence(tmp_path, capsys, argv, said):
    assert main(["tune", "--model", "llama3-8b", "--hardware", "h100-80gb", *argv, "--out", str(tmp_path)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and said in error
    assert not list(tmp_path.iterdir())


def test_pinned_options_reach_plan_yaml_and_the_engine_left_open_follows_them(tmp_path):
    assert main(["tune", "--model", "llama3-8b", "--hardware", "h100-80gb", "--tp", "2", "--tp-comm-overlap",
                 "--grad-reduce-in-bf16", "--out", str(tmp_path)]) == 0
    plan = read_plan(tmp_path / "plan.yaml")
    assert plan.engine == "megatron" and plan.tp_comm_overlap and not plan.grad_reduce_in_fp32
    text = (tmp_path / "megatron_args.txt").read_text().splitlines()
    assert "--tp-comm-overlap" in text and "--grad-reduce-in-bf16" in text


def test_plans_edited_to_options_their_engine_cannot_run_are_refused():
    deepspeed = make_plan("llama3-8b", "h100-80gb", engine="deepspeed")
    with pytest.raises(ValueError, match="tp_comm_overlap needs a Megatron-core plan"):
        dataclasses.replace(deepspeed, tp_comm_overlap=True)
    with pytest.raises(ValueError, match="bf16 gradients"):
        dataclasses.replace(deepspeed, grad_reduce_in_fp32=False)
    megatron_tp1 = make_plan("llama3-8b", "h100-80gb", **{**PINS, "tp": 1})
    with pytest.raises(ValueError, match="with tp > 1"):
        dataclasses.replace(megatron_tp1, tp_comm_overlap=True)


def test_sequence_parallelism_only_where_tp_divides_each_ranks_tokens():
    """Megatron-core's sequence parallelism scatters a cp rank's tokens over tp, and its
    _split_along_first_dim asserts tp divides them: a 2049-token sequence (one label token too many)
    plans tp > 1 without it, said in a warning where tp is pinned; an MoE model, whose tensor
    parallelism needs it, and a pinned --sequence-parallel are refused in one sentence."""
    import warnings as _warnings

    from dsauto.api import make_problem
    from dsauto.errors import DsautoError, DsautoWarning
    from dsauto.search.space import Constraints, strategies
    from dsauto.spec.cluster import ClusterSpec
    from dsauto.spec.loaders import load_hardware, load_model
    from dsauto.spec.training import TrainSpec

    cluster = ClusterSpec(load_hardware("h100-80gb"), nodes=1, gpus_per_node=8)
    llama = load_model("llama3-8b")
    odd = strategies(llama, cluster, TrainSpec(global_batch=16, seq_len=2049), Constraints(engine="megatron"))
    assert any(s.tp > 1 for s in odd) and not any(s.sequence_parallel for s in odd)
    even = strategies(llama, cluster, TrainSpec(global_batch=16, seq_len=2048), Constraints(engine="megatron"))
    assert all(s.sequence_parallel for s in even if s.tp > 1)
    with pytest.warns(DsautoWarning, match=r"without sequence parallelism: it splits each sequence's 2049 tokens "
                                           r"over tp 8, which does not divide them"):
        make_problem("llama3-8b", "h100-80gb", engine="megatron", tp=8, seq_len=2049, global_batch=16)
    with _warnings.catch_warnings():
        _warnings.simplefilter("error")
        make_problem("llama3-8b", "h100-80gb", engine="megatron", tp=8, seq_len=2048, global_batch=16)
    with pytest.raises(DsautoError, match=r"Sequence parallelism splits each sequence's 2049 tokens over tp 8, which "
                                          r"does not divide them, and it is pinned on; pin a --seq-len that is a multiple of 8"):
        from dsauto.api import find_plans
        find_plans(make_problem("llama3-8b", "h100-80gb", engine="megatron", tp=8, seq_len=2049, global_batch=16,
                                sequence_parallel=True))


def test_contradictory_and_unmet_pins_say_their_numbers(capsys):
    """--tp-comm-overlap with --no-sequence-parallel is refused (it overlaps sequence parallelism's
    collectives); a --vpp whose step has a number of micro-batches pp does not divide says the count."""
    from dsauto.cli import main

    assert main(["plan", "--model", "llama3-8b", "--hardware", "h100-80gb", "--engine", "megatron", "--tp", "2",
                 "--tp-comm-overlap", "--no-sequence-parallel"]) == 2
    assert ("--tp-comm-overlap overlaps the tensor-parallel collectives of sequence parallelism, and "
            "--no-sequence-parallel turns it off; leave out one of them.") in capsys.readouterr().err
    assert main(["plan", "--model", "llama3-70b", "--hardware", "h100-80gb", "--nodes", "8", "--engine", "megatron",
                 "--tp", "8", "--pp", "4", "--vpp", "2", "--global-batch", "20", "--micro-batch", "1"]) == 2
    assert ("--vpp 2 cannot run: the interleaved schedule needs the micro-batches of a step to be a multiple of pp 4, "
            "and global batch 20 / (dp 2 x micro-batch 1) gives 10; change --global-batch, --micro-batch or --pp."
            ) in capsys.readouterr().err
