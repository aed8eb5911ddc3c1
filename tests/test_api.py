"""The Python facade: the same defaults and knobs as the command line, and the README's example runs."""

from __future__ import annotations

import dataclasses
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dsauto
from dsauto.api import find_plans, make_plan, make_problem
from dsauto.cli import main
from dsauto.errors import DsautoError, DsautoWarning
from dsauto.plan_io import read_plan
from dsauto.search.space import Constraints
from dsauto.spec.loaders import load_cluster, load_model
from dsauto.spec.training import TrainSpec

README = Path(__file__).resolve().parents[1] / "README.md"
PRESETS = Path(__file__).resolve().parents[1] / "templates"


def _keywords(function) -> dict[str, object]:
    return {name: p.default for name, p in inspect.signature(function).parameters.items()}


def test_every_train_and_constraints_field_is_a_keyword_of_make_problem():
    keywords = _keywords(make_problem)
    for field in dataclasses.fields(TrainSpec) + dataclasses.fields(Constraints):
        assert field.name in keywords, f"make_problem has no keyword for {field.name}"
    # A pin left out leaves the choice to the search, exactly as the dataclass's own default does.
    for field in dataclasses.fields(Constraints):
        assert keywords[field.name] == field.default, field.name
    assert keywords["flash_attention"] == TrainSpec.flash_attention


def test_make_plan_takes_the_keywords_of_make_problem_and_a_profile():
    assert _keywords(make_plan) == {**_keywords(make_problem), "profile": None}


SAMPLES = {"global_batch": 16, "seq_len": 64, "dtype": "fp16", "flash_attention": False, "tp": 2, "pp": 2,
           "zero_stage": 1, "micro_batch": 4, "checkpoint": True, "sequence_parallel": False, "engine": "megatron",
           "vpp": 2, "cp": 2, "ep": 2, "etp": 2, "recompute_modules": "core_attn", "offload": "optimizer",
           "hpz": 2, "dist_opt_instances": 2, "attention_kernel": "flash", "tp_comm_overlap": True,
           "grad_reduce_in_fp32": False, "expert_dispatcher": "deepep", "fp8": True, "fp8_recipe": "tensorwise",
           "fp8_param_gather": True, "cp_comm_type": "all_gather", "expert_a2a_overlap": True,
           "stage_layers": "even", "recompute_num_layers": 2, "expert_load_balanced": True,
           "precision_aware_optimizer": "bf16", "attention_softmax_in_fp32": False, "hf_trainer": True,
           "expert_capacity_factor": 1.25, "expert_pad_to_capacity": True, "overlap_grad_reduce": False,
           "overlap_param_gather": False}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_keyword_reaches_its_field(name):
    assert set(SAMPLES) == {f.name for f in dataclasses.fields(TrainSpec) + dataclasses.fields(Constraints)}
    # FP8 needs a device with an FP8 peak, and its recipe needs FP8 on; filling experts to capacity a capacity
    extra = {"hardware": "h100-80gb"} if name == "fp8" else {"hardware": "h100-80gb", "fp8": True} \
        if name in ("fp8_recipe", "fp8_param_gather") else {"expert_capacity_factor": 1.0} \
        if name == "expert_pad_to_capacity" else {}
    problem = make_problem(**{name: SAMPLES[name]}, **extra)
    spec = problem.train if name in {f.name for f in dataclasses.fields(TrainSpec)} else problem.pins
    assert getattr(spec, name) == SAMPLES[name]


def test_defaults_are_the_command_line_defaults(tmp_path, capsys):
    problem = make_problem()
    assert (problem.model.name, problem.cluster.hardware.name, problem.cluster.world_size) == ("gpt-tiny", "cpu", 2)
    assert problem.train.global_batch == max(8, problem.cluster.world_size)
    assert problem.train.seq_len == min(2048, problem.model.max_position_embeddings)
    assert problem.train.dtype == problem.cluster.hardware.dtype
    assert problem.pins == Constraints()
    big = make_problem("llama3-8b", "h100-80gb", nodes=2)
    assert (big.train.seq_len, big.train.global_batch, big.train.dtype) == (2048, 16, "bf16")

    assert main(["tune", "--out", str(tmp_path / "o")]) == 0
    capsys.readouterr()
    assert read_plan(tmp_path / "o" / "plan.yaml") == make_plan()


def test_model_and_hardware_as_objects_or_paths():
    model, cluster = load_model("gpt-tiny"), load_cluster("cpu")
    by_object = make_problem(model, cluster, nodes=2, memory_limit="1GiB")
    assert by_object.cluster.world_size == 4 and by_object.cluster.memory_budget_bytes == 2**30
    assert make_problem(model, cluster.hardware).cluster == cluster
    by_path = make_problem(PRESETS / "models" / "gpt-tiny.yaml", PRESETS / "hardware" / "cpu.yaml")
    assert by_path.model.num_parameters() == model.num_parameters()
    assert by_path.cluster.world_size == cluster.world_size


@pytest.mark.parametrize("call, message", [
    (lambda: make_problem(seq_len=10**6), r"Sequences of 1000000 tokens exceed the \d+ positions gpt-tiny"),
    (lambda: make_problem(load_model("gpt-tiny"), load_cluster("cpu"), memory_limit="1TiB"),
     r"memory limit 1\.0 TiB is more than"),
    (lambda: find_plans(make_problem(), top_k=0), r"top_k must be at least 1"),
    (lambda: make_plan(tp=3), r"4 attention heads are not divisible by TP 3"),
    (lambda: make_plan(profile="no-such-profiles"), r"The profile no-such-profiles does not exist"),
    # pins and workloads of the wrong kind, which the command line's option types refuse
    (lambda: make_problem(engine="megatorn"), r"engine='megatorn' is not a pin .*--engine.*'deepspeed', 'megatron'"),
    (lambda: make_problem(checkpoint="none"), r"checkpoint='none' is not a pin .* one of True, False"),
    (lambda: make_problem(tp=0), r"tp=0 is not a pin .* a whole number from 1"),
    (lambda: make_problem(micro_batch=2.0), r"micro_batch=2\.0 is not a pin"),
    (lambda: make_problem(zero_stage=True), r"zero_stage=True is not a pin .* one of 0, 1, 2, 3"),
    (lambda: make_problem(fp8="yes"), r"fp8='yes' is not a pin .* True or False"),
    (lambda: make_problem(global_batch=0), r"global_batch must be from 1"),
    (lambda: make_problem(global_batch=8.0), r"global_batch must be a whole number, got 8\.0"),
    (lambda: make_problem(dtype="bf17"), r"dtype must be one of bf16, fp16, fp32, got 'bf17'"),
    (lambda: make_problem(gpus_per_node=2.5), r"devices per node must be a whole number, got 2\.5"),
    (lambda: make_problem(seq_len=0), r"seq_len must be from 1 to \d+, got 0; change --seq-len\."),
    (lambda: make_problem(flash_attention=1), r"flash_attention must be True or False, got 1; change "
                                               r"--no-flash-attention\."),
])
def test_user_errors_are_one_sentence(call, message):
    with pytest.raises(DsautoError, match=message):
        call()


def test_pins_of_numpy_integers_and_false_for_hf_read_as_their_python_values():
    import numpy as np

    problem = make_problem(tp=np.int64(2), zero_stage=np.int64(1), global_batch=np.int64(16),
                           gpus_per_node=np.int64(2), hf_trainer=False)
    assert (problem.pins.tp, problem.pins.zero_stage, problem.train.global_batch, problem.cluster.world_size) == (
        2, 1, 16, 2) and type(problem.pins.tp) is int and problem.pins.hf_trainer is None
    assert make_problem(hf_trainer=True).pins.engine == "deepspeed"  # what Hugging Face's Trainer runs


def test_top_k_plans_best_first():
    plans = find_plans(make_problem(), top_k=3)
    assert len(plans) == 3
    times = [p.prediction.step_seconds for p in plans]
    assert times == sorted(times)
    assert plans[0] == make_plan()


def test_import_dsauto_stays_light_and_every_export_resolves():
    probe = ("import sys, dsauto; heavy = [m for m in ('dsauto.api', 'dsauto.search.planner', 'numpy', 'torch') "
             "if m in sys.modules]; print(heavy)")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"
    for name in dsauto.__all__:
        assert getattr(dsauto, name) is not None
    with pytest.raises(AttributeError):
        dsauto.no_such_name  # noqa: B018
    from dsauto import megatron  # a submodule, not an export: still imports

    assert megatron.__name__ == "dsauto.megatron"


def test_type_checkers_see_every_lazy_export():
    import ast

    tree = ast.parse(Path(dsauto.__file__).read_text())
    guarded = next(node for node in tree.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test))
    seen = {alias.asname for node in guarded.body for alias in node.names}
    assert seen == set(dsauto.__all__) - {"__version__"}


def _readme_example() -> str:
    section = README.read_text().split("## Planning from Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_example_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    exec(compile(_readme_example(), "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "dsauto plan: llama3-8b" in out and "next plans:" in out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["ds_config.json", "megatron_args.txt",
                                                                   "plan.png", "plan.yaml"]


def test_ids_do_not_move_when_a_field_with_its_default_is_added():
    """A plan's id, a study's name and a profile's key hash the content without the fields at their
    defaults, so that a later dsauto adding a field (its default keeping the old meaning) still finds
    the profiles, studies and artifact sets written before it."""
    import dataclasses as dc

    from dsauto.plan_io import plan_id
    from dsauto.serde import content_dict

    plan = make_plan("gpt-tiny", "cpu")
    assert "unmodelled" not in content_dict(plan.model) and "name" in content_dict(plan.model)
    with_field = dc.make_dataclass("Later", [("added", int, dc.field(default=0))], bases=(type(plan.model),),
                                   frozen=True)
    later = with_field(**{f.name: getattr(plan.model, f.name) for f in dc.fields(plan.model)})
    assert content_dict(later) == content_dict(plan.model)
    assert plan_id(dc.replace(plan, model=later)) == plan_id(plan)
    assert plan_id(dc.replace(plan, model=dc.replace(later, added=1))) != plan_id(plan)  # a value that counts


def test_hpz_over_all_of_dp_and_alibi_context_are_said_as_they_are():
    with pytest.warns(DsautoWarning, match=r"--hpz 8 spans the plan's whole data-parallel group \(dp 8\), so its "
                                           r"secondary copy of the parameters is partitioned as the primary one"):
        make_plan("llama2-7b", "a100-80gb", gpus_per_node=8, global_batch=64, engine="deepspeed", zero_stage=3, hpz=8)
    bloom = load_model(str(Path(__file__).parent / "spec" / "configs" / "bloom-560m.json"))
    with pytest.warns(DsautoWarning) as said:
        make_problem(bloom, "a100-80gb", seq_len=4096)
    text = " ".join(str(w.message) for w in said)
    assert "planning 4096-token sequences extends its context." in text and "rotary" not in text
