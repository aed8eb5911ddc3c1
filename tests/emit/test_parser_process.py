"""DeepSpeed's parser in a process of its own says what it says in-process: the same refusal, the
same warnings; and a process that fails leaves the parsing to this one."""

from __future__ import annotations

import copy
import importlib

import pytest

from dsauto.emit import parser_process
from dsauto.emit.ds_config import ds_config, validate_ds_config
from dsauto.emit.parser_process import ParserProcess
from dsauto.errors import DsautoError, DsautoWarning


def test_the_process_refuses_and_warns_as_the_parser_does_in_process(zero3_plan, monkeypatch):
    def parsed_here(*args):
        raise AssertionError("the config was parsed in this process, not by the parser process")

    config = copy.deepcopy(ds_config(zero3_plan))
    config["gradient_clip"] = config.pop("gradient_clipping", 1.0)  # read by nobody: a warning
    off_by_one = dict(config, train_batch_size=config["train_batch_size"] + 1)
    with pytest.raises(DsautoError) as in_process:
        validate_ds_config(off_by_one, zero3_plan.dp)
    monkeypatch.setattr(parser_process, "validate_ds_config", parsed_here)  # the fallback would fail
    with pytest.warns(DsautoWarning, match=r"reads no top-level key 'gradient_clip'"):
        ParserProcess().validate(config, zero3_plan.dp)
    with pytest.raises(DsautoError) as apart:
        ParserProcess().validate(off_by_one, zero3_plan.dp)
    assert str(apart.value) == str(in_process.value)
    assert "17 != 2 * 4 * 2" in str(apart.value)


def test_a_process_that_ends_unanswered_leaves_the_parsing_here(zero3_plan):
    """A parser process killed before it answers (out of memory, say) costs nothing but time: the
    config is parsed in-process, whose refusal is the one raised."""
    config = dict(ds_config(zero3_plan), train_batch_size=1)
    parser = ParserProcess()
    parser._process.kill()
    with pytest.raises(DsautoError, match=r"1 != 2 \* 4 \* 2"):
        parser.validate(config, zero3_plan.dp)


def test_validate_parses_in_process_once_deepspeed_is_imported_here(zero3_plan, monkeypatch):
    """With DeepSpeed imported, a waiting process is ended unasked, and nothing new is started."""
    importlib.import_module("deepspeed.runtime.config")  # the condition under test

    monkeypatch.setattr(parser_process, "_started", None)
    parser_process.start_parser()
    assert parser_process._started is None
    waiting = ParserProcess()
    monkeypatch.setattr(parser_process, "_started", waiting)
    parser_process.validate(ds_config(zero3_plan), zero3_plan.dp)
    assert parser_process._started is None and waiting._process.poll() is not None
