"""plan.png: the plan's picture is drawn for real plans."""

from __future__ import annotations

import pytest

from dsauto.cost.pipeline import simulate_1f1b, simulate_interleaved
from dsauto.emit import plot
from dsauto.emit.plot import plot_plan
from dsauto.search.planner import Planner
from dsauto.search.space import Constraints
from dsauto.spec.loaders import load_cluster, load_model
from dsauto.spec.training import TrainSpec

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def gpt2_xl_plan(pp):
    return Planner(load_model("gpt2-xl"), load_cluster("a100-80gb", nodes=1, gpus_per_node=8),
                   TrainSpec(global_batch=32, seq_len=1024), Constraints(pp=pp)).search()[0]


@pytest.mark.parametrize("pp", [1, 8])
def test_plot_writes_a_png(pp, tmp_path):
    plan = gpt2_xl_plan(pp)
    assert plan.pp == pp
    path = plot_plan(plan, tmp_path / "plan.png")
    assert path == tmp_path / "plan.png"
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_many_micro_batches_are_simulated_only_as_far_as_drawn(make_plan, layer_runs, pipeline_plan,
                                                               tmp_path, monkeypatch):
    # pp=2 x m=4096 is over MAX_DRAWN_OPS: only the first DRAWN_MICRO_BATCHES are drawn, and the
    # simulation needs no more than DRAWN_MICRO_BATCHES + pp micro-batches for them.
    model = pipeline_plan.model
    plan = make_plan(model, dp=2, tp=2, pp=2, zero_stage=1, stage_layers=(2, 4),
                     layers=layer_runs(model, (2, 4)), micro_batch=1, grad_accum=4096)
    simulated = []

    def spy(forward, backward, micro_batches):
        simulated.append(micro_batches)
        return simulate_1f1b(forward, backward, micro_batches)

    monkeypatch.setattr(plot, "simulate_1f1b", spy)
    assert plot_plan(plan, tmp_path / "plan.png").read_bytes().startswith(PNG_MAGIC)
    assert simulated == [plot.DRAWN_MICRO_BATCHES + 2]


def test_the_truncated_simulation_agrees_with_the_whole_one():
    # What the capped picture relies on: the first micro-batches of a long step do not depend on
    # how many follow once there are at least DRAWN_MICRO_BATCHES + pp of them.
    forward, backward, drawn = [0.2, 0.5, 0.3, 0.4], [0.6, 0.9, 0.5, 1.1], 8
    whole = simulate_1f1b(forward, backward, 40)
    short = simulate_1f1b(forward, backward, drawn + len(forward))
    horizon = next(end for kind, j, _, end in whole[0] if kind == "B" and j == drawn - 1)
    for long_stage, short_stage in zip(whole, short):
        assert [op for op in long_stage if op[2] < horizon] == [op for op in short_stage if op[2] < horizon]


def test_an_interleaved_plan_is_drawn_as_its_schedule_runs(tmp_path, monkeypatch):
    """A plan with virtual stages is drawn as Megatron-core's interleaved schedule of its own chunk
    times, not as 1F1B over its stages."""
    plan = Planner(load_model("gpt2-xl"), load_cluster("a100-80gb", nodes=1, gpus_per_node=8),
                   TrainSpec(global_batch=32, seq_len=1024), Constraints(pp=4, vpp=2, engine="megatron")).search()[0]
    assert plan.virtual_stages == 2
    simulated = []

    def spy(forward, backward, micro_batches, extra_warmup=0):
        simulated.append((forward, backward, micro_batches))
        return simulate_interleaved(forward, backward, micro_batches, extra_warmup)

    monkeypatch.setattr(plot, "simulate_interleaved", spy)
    monkeypatch.setattr(plot, "simulate_1f1b", None)  # not drawn as 1F1B
    assert plot_plan(plan, tmp_path / "plan.png").read_bytes().startswith(PNG_MAGIC)
    assert simulated == [([list(st.chunk_forward_seconds) for st in plan.stages],
                          [list(st.chunk_backward_seconds) for st in plan.stages], plan.grad_accum)]


def test_the_truncated_interleaved_simulation_agrees_with_the_whole_one():
    # As for 1F1B: the capped picture simulates pp * (ceil(drawn / pp) + 4) micro-batches.
    forward = [[0.2, 0.1], [0.5, 0.4], [0.3, 0.3], [0.4, 0.2]]
    backward = [[2 * t for t in row] for row in forward]
    drawn, pp = 8, len(forward)
    whole = simulate_interleaved(forward, backward, 80)
    short = simulate_interleaved(forward, backward, pp * (-(-drawn // pp) + 4))
    horizon = next(end for kind, j, c, _, end in whole[0] if kind == "B" and j == drawn - 1 and c == 0)
    for long_rank, short_rank in zip(whole, short):
        assert [op for op in long_rank if op[3] < horizon] == [op for op in short_rank if op[3] < horizon]


def test_the_title_names_every_degree(tmp_path, monkeypatch):
    """A plan with context parallelism and virtual stages is titled with them: tp, pp and dp alone
    would count fewer devices than the plan runs on."""
    from matplotlib.figure import Figure

    plan = Planner(load_model("llama2-7b"), load_cluster("a100-80gb", nodes=2, gpus_per_node=8),
                   TrainSpec(global_batch=16, seq_len=16384),
                   Constraints(engine="megatron", tp=2, pp=2, cp=2, vpp=2)).search()[0]
    titles = []
    original = Figure.suptitle
    monkeypatch.setattr(Figure, "suptitle", lambda fig, text, **kw: titles.append(text) or original(fig, text, **kw))
    plot_plan(plan, tmp_path / "plan.png")
    assert f"tp=2 pp=2 dp={plan.dp} cp=2 vpp=2, ZeRO-" in titles[0]
