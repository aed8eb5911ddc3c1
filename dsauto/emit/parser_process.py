"""DeepSpeed's config parser in a process of its own, started before the config exists.

Importing DeepSpeed, and torch under it, takes longer than dsauto's search: 3.1 s of an 8.0 s
``dsauto tune`` of llama3-405b on two loaded cores, against 1.4 s of search and 2.9 s of drawing
plan.png. ``dsauto tune`` starts this process as it begins (:func:`start_parser`), so the import runs
beside the search and the drawing, and hands it the config once written (:func:`validate`). The
process parses it with :func:`~dsauto.emit.ds_config.validate_ds_config`, as the command would
in-process, and sends back the same refusal and the same warnings.

Where DeepSpeed is imported already (a second plan in one process, the tests), parsing in-process
costs nothing, and that is what happens. A process that cannot start, dies, or does not answer
within ``ANSWER_TIMEOUT_S`` is killed, and the config is parsed in-process instead, which raises
whatever it raises: the process only ever saves time.
"""

from __future__ import annotations

import atexit
import builtins
import importlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

from dsauto.emit.ds_config import validate_ds_config
from dsauto.errors import DsautoError, DsautoWarning

ANSWER_TIMEOUT_S = 600.0
"""How long the parser may take after it is handed the config (its import included, when it was
started late) before it is killed and the config parsed in-process."""

_ENTRY = "from dsauto.emit.parser_process import serve; raise SystemExit(serve())"


class ParserProcess:
    """A Python process importing DeepSpeed's config module, then parsing the one config it is sent."""

    def __init__(self) -> None:
        package_root = str(Path(__file__).resolve().parents[2])  # the folder holding dsauto/
        path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        self._process = subprocess.Popen(  # raises OSError where no process can start
            [sys.executable, "-c", _ENTRY], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=path), text=True)

    def validate(self, config: dict[str, Any], dp: int) -> None:
        """What :func:`~dsauto.emit.ds_config.validate_ds_config` does with ``config`` on ``dp``
        ranks: the same DsautoError, the same warnings; parsed in-process if this process fails."""
        answer = self._ask(json.dumps({"config": config, "dp": dp}) + "\n")
        if answer is None:
            validate_ds_config(config, dp)
            return
        for warning in answer["warnings"]:
            if warning["dsauto"]:
                warnings.warn(warning["message"], DsautoWarning, stacklevel=3)
            else:  # DeepSpeed's or torch's own, as they would have said it here
                category = getattr(builtins, warning["category"], UserWarning)
                if not (isinstance(category, type) and issubclass(category, Warning)):
                    category = UserWarning
                warnings.warn_explicit(warning["message"], category, warning["filename"], warning["lineno"])
        if answer["error"] is not None:
            raise DsautoError(answer["error"])

    def close(self) -> None:
        """Ends the process unanswered (a command that wrote no config)."""
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        for stream in (self._process.stdin, self._process.stdout):
            if stream is not None:
                stream.close()

    def _ask(self, request: str) -> dict[str, Any] | None:
        try:
            out, _ = self._process.communicate(request, timeout=ANSWER_TIMEOUT_S)
        except (subprocess.TimeoutExpired, OSError):
            self.close()
            return None
        if self._process.returncode != 0:
            return None
        try:
            answer = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return None
        return answer if isinstance(answer, dict) and {"error", "warnings"} <= set(answer) else None


_started: ParserProcess | None = None


def start_parser() -> None:
    """Starts the parser process, unless one is waiting or DeepSpeed is imported in this one."""
    global _started
    if _started is not None or "deepspeed" in sys.modules:
        return
    try:
        _started = ParserProcess()
    except OSError:
        return  # no process to spare: validate() parses in-process
    atexit.register(_close_started)


def validate(config: dict[str, Any], dp: int) -> None:
    """Parses ``config`` with DeepSpeed's parser as :func:`~dsauto.emit.ds_config.validate_ds_config`
    does, in the process :func:`start_parser` started if one is waiting and DeepSpeed is still not
    imported here, else in-process."""
    global _started
    parser, _started = _started, None
    if parser is not None and "deepspeed" not in sys.modules:
        parser.validate(config, dp)
        return
    if parser is not None:
        parser.close()
    validate_ds_config(config, dp)


def _close_started() -> None:
    global _started
    parser, _started = _started, None
    if parser is not None:
        parser.close()


def serve() -> int:
    """The parser process: imports DeepSpeed's config module, reads one request from standard input,
    and writes the answer as one line of JSON to standard output; DeepSpeed's and torch's own prints
    go to standard error. Nothing to read (the command wrote no config) ends it quietly."""
    answer_to = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    with warnings.catch_warnings(record=True) as caught:
        importlib.import_module("deepspeed.runtime.config")  # the seconds this process exists to spend early

        line = sys.stdin.readline()
        if not line.strip():
            return 0
        request = json.loads(line)
        try:
            validate_ds_config(request["config"], request["dp"])
            error = None
        except DsautoError as exc:
            error = str(exc)
    said = [{"dsauto": issubclass(w.category, DsautoWarning), "category": w.category.__name__,
             "message": str(w.message), "filename": w.filename, "lineno": w.lineno} for w in caught]
    answer_to.write(json.dumps({"error": error, "warnings": said}) + "\n")
    answer_to.close()
    return 0
