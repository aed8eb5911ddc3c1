"""benchmarks/holdout.py: the held-out published runs are well formed, each command is one the
command line accepts, and the harness prices them as ``dsauto plan`` does."""

from __future__ import annotations

import re

import pytest
import yaml

from benchmark_modules import BENCHMARKS, load

holdout = load("holdout")
RECORDS = yaml.safe_load((BENCHMARKS / "holdout_runs.yaml").read_text())
FIELDS = {"id", "source_key", "citation", "location", "hardware", "gpus", "gpus_per_node", "model",
          "model_description", "options", "published", "published_step_seconds", "step_formula", "recompute", "notes"}


def test_every_record_says_where_its_numbers_come_from():
    assert len({r["id"] for r in RECORDS}) == len(RECORDS)
    for record in RECORDS:
        assert FIELDS <= record.keys(), (record["id"], FIELDS - record.keys())
        assert record["published_step_seconds"] > 0 and record["gpus"] % record["gpus_per_node"] == 0
        # The derived step time is the formula's own arithmetic.
        formula = record["step_formula"].rsplit("=", 1)[1]
        assert re.fullmatch(r"[0-9.*/() ]+", formula), record["id"]
        assert eval(formula) == pytest.approx(record["published_step_seconds"], rel=1e-5), record["id"]


def test_every_command_is_one_the_command_line_accepts():
    from dsauto.cli import build_parser

    for record in RECORDS:
        args = build_parser().parse_args(holdout.command(record))
        assert args.engine == "megatron" and args.micro_batch and args.tp and args.pp, record["id"]


@pytest.mark.parametrize("run_id", ["zb-t4-1.5b-8gpu-mb6-m24-1f1b", "tinyllama-1.1b-16xa100-40g",
                                    "zb-t4-1.5b-8gpu-mb6-m24-1f1bi"])
def test_the_harness_prices_a_run_as_the_command_line_does(capsys, run_id):
    from dsauto.cli import main

    record = next(r for r in RECORDS if r["id"] == run_id)
    priced = holdout.price(record)
    code = main(holdout.command(record))
    out, err = capsys.readouterr()
    if priced.plan is None:  # refused, in the command line's own sentence
        assert code == 2 and priced.refusal in err
        return
    assert code == 0 and priced.fits
    step = float(re.search(r"predicted \(analytic\)\s+step ([0-9.]+) s", out).group(1))
    assert priced.plan.prediction.step_seconds == pytest.approx(step, rel=1e-3)
    assert priced.plan.dims.pp == int(re.search(r"--pp (\d+)", record["options"]).group(1))
