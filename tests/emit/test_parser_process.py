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


def test_the_process_imports_what_the_command_imports_and_ends_with_it(tmp_path):
    """The process takes the command's sys.path, not its own working folder's (a deepspeed source tree
    there would be imported first by ``python -c``); and it dies with the command, by the kernel's
    parent-death signal."""
    import os
    import subprocess
    import sys

    import psutil

    work, scripts = tmp_path / "work", tmp_path / "scripts"
    (work / "deepspeed").mkdir(parents=True)
    (work / "deepspeed" / "__init__.py").write_text("raise ImportError('the working folder was imported')")
    scripts.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    answered = ("from dsauto.emit import parser_process as pp; from dsauto.emit.ds_config import ds_config; "
                "from dsauto.search.planner import Planner; from dsauto.spec.loaders import load_cluster, "
                "load_model; from dsauto.spec.training import TrainSpec; "
                "plan = Planner(load_model('gpt-tiny'), load_cluster('cpu', nodes=1, gpus_per_node=2), "
                "TrainSpec(4, 64, 'fp32')).search()[0]; "
                "pp.validate_ds_config = lambda *a: (_ for _ in ()).throw(SystemExit('parsed in-process')); "
                "pp.ParserProcess().validate(ds_config(plan), plan.dp)")
    (scripts / "answered.py").write_text(answered)  # a script: its folder on sys.path, not the working one
    run = subprocess.run([sys.executable, scripts / "answered.py"], cwd=work, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]

    waiting = ("import time; from dsauto.emit.parser_process import ParserProcess; "
               "print(ParserProcess()._process.pid, flush=True); time.sleep(60)")
    command = subprocess.Popen([sys.executable, "-c", waiting], cwd=scripts, env=env, stdout=subprocess.PIPE,
                               text=True)
    child = psutil.Process(int(command.stdout.readline()))
    command.kill()
    command.wait()
    command.stdout.close()
    child.wait(timeout=60)  # killed by the kernel as its parent died, not after its import


def test_a_forwarded_warning_keeps_its_module_for_the_commands_filters(zero3_plan, monkeypatch):
    """A third-party warning the process forwards is said under the module that warned, so that a
    module-scoped filter of the command (``-W ignore::FutureWarning:torch``) matches it as it would
    have in-process; the process names the module from the warning's file."""
    import warnings

    said = {"error": None, "warnings": [{
        "dsauto": False, "category": "FutureWarning", "builtin": "FutureWarning", "message": "an old argument",
        "filename": "/site-packages/torch/serialization.py", "lineno": 7, "module": "torch.serialization"}]}
    monkeypatch.setattr(ParserProcess, "_ask", lambda self, config, dp: said)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch")
        ParserProcess().validate(ds_config(zero3_plan), zero3_plan.dp)
        assert shown == []
        warnings.filterwarnings("ignore", category=FutureWarning, module="deepspeed")
        warnings.filterwarnings("always", category=FutureWarning, module="torch")
        ParserProcess().validate(ds_config(zero3_plan), zero3_plan.dp)
    assert [(w.category, str(w.message), w.lineno) for w in shown] == [(FutureWarning, "an old argument", 7)]
