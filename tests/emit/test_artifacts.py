"""write_artifacts: validated first, all four files or none, other files untouched."""

from __future__ import annotations

import pytest

from dsauto.emit import artifacts
from dsauto.emit.artifacts import write_artifacts
from dsauto.emit.megatron import megatron_args
from dsauto.errors import DsautoError
from dsauto.plan_io import read_plan

NAMES = ["ds_config.json", "megatron_args.txt", "plan.yaml", "plan.png"]


def listing(root):
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


def test_writes_the_four_artifacts(plan, tmp_path):
    out = tmp_path / "nested" / "out"
    written = write_artifacts(plan, out)
    assert [path.name for path in written] == NAMES
    assert all(path.parent == out for path in written)
    assert read_plan(out / "plan.yaml") == plan
    assert read_plan(out / "ds_config.json") == plan
    assert (out / "megatron_args.txt").read_text().splitlines() == megatron_args(plan)
    assert (out / "plan.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    # Nothing is left next to out_dir but out_dir itself.
    assert [path.name for path in out.parent.iterdir()] == ["out"]


def test_existing_files_are_replaced_and_others_kept(zero3_plan, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "plan.yaml").write_text("old")
    write_artifacts(zero3_plan, out)
    assert (out / "notes.txt").read_text() == "mine"
    assert read_plan(out / "plan.yaml") == zero3_plan
    assert sorted(path.name for path in out.iterdir()) == sorted(NAMES + ["notes.txt"])


@pytest.fixture
def populated(tmp_path):
    """An output directory holding a previous run's files and a file of the user's."""
    out = tmp_path / "out"
    out.mkdir()
    for name in NAMES + ["notes.txt"]:
        (out / name).write_text(f"previous {name}")
    return out


def assert_untouched(out):
    assert listing(out.parent) == sorted(["out"] + [f"out/{name}" for name in NAMES + ["notes.txt"]])
    for name in NAMES + ["notes.txt"]:
        assert (out / name).read_text() == f"previous {name}"


def reject(config, dp):
    raise DsautoError("DeepSpeed rejects the config: no.")


def test_validation_failure_writes_nothing(zero3_plan, populated, monkeypatch):
    monkeypatch.setattr(artifacts.parser_process, "validate", reject)
    with pytest.raises(DsautoError, match="DeepSpeed rejects"):
        write_artifacts(zero3_plan, populated)
    assert_untouched(populated)


def test_validation_failure_creates_no_directory(zero3_plan, tmp_path, monkeypatch):
    monkeypatch.setattr(artifacts.parser_process, "validate", reject)
    with pytest.raises(DsautoError):
        write_artifacts(zero3_plan, tmp_path / "out")
    assert listing(tmp_path) == []


def test_failure_while_writing_leaves_no_partial_files(zero3_plan, populated, monkeypatch):
    def write_half(plan, path):
        path.write_text("model:\n  name: tiny")  # a partial plan.yaml, then the disk fills up
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(artifacts, "write_plan_yaml", write_half)
    with pytest.raises(OSError):
        write_artifacts(zero3_plan, populated)
    assert_untouched(populated)


def test_failure_while_plotting_leaves_no_partial_files(zero3_plan, populated, monkeypatch):
    def plot_half(plan, path):
        path.write_bytes(b"\x89PNG\r\n\x1a\n")  # the header, then matplotlib fails
        raise RuntimeError("plotting failed")

    monkeypatch.setattr(artifacts, "plot_plan", plot_half)
    with pytest.raises(RuntimeError, match="plotting failed"):
        write_artifacts(zero3_plan, populated)
    assert_untouched(populated)


def test_a_folder_where_an_artifact_goes_leaves_every_file_as_it_was(zero3_plan, populated):
    """plan.png is renamed last: a folder in its place would fail after the other three were
    replaced; it is refused, naming it, before any rename."""
    (populated / "plan.png").unlink()
    (populated / "plan.png").mkdir()
    with pytest.raises(DsautoError, match=r"plan\.png is a folder where dsauto writes its plan\.png; move it or "
                                          r"choose another --out \(nothing was written\)\."):
        write_artifacts(zero3_plan, populated)
    for name in NAMES + ["notes.txt"]:
        if name != "plan.png":
            assert (populated / name).read_text() == f"previous {name}"
    assert (populated / "plan.png").is_dir() and not any(p.name.startswith(".") for p in populated.iterdir())


def test_a_plan_deepspeed_refuses_is_not_written(make_plan, layer_runs, pipeline_plan, tmp_path):
    model = pipeline_plan.model
    plan = make_plan(model, dp=2, tp=1, pp=2, zero_stage=3, stage_layers=(3, 3),
                     layers=layer_runs(model, (3, 3)))
    with pytest.raises(DsautoError, match="pipeline engine refuses ZeRO stage 3"):
        write_artifacts(plan, tmp_path / "out")
    assert listing(tmp_path) == []
