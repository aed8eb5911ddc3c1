"""DeepSpeed's config parser in a process of its own, started before the config exists.

Importing DeepSpeed, and torch under it, takes longer than dsauto's search: 3.1 s of an 8.0 s
``dsauto tune`` of llama3-405b on two loaded cores (under cProfile), against 1.4 s of search and
2.9 s of drawing plan.png. ``dsauto tune`` starts this process as it begins (:func:`start_parser`), so the import runs
beside the search and the drawing, and hands it the config once written (:func:`validate`). The
process parses it with :func:`~dsauto.emit.ds_config.validate_ds_config`, as the command would
in-process, and sends back the same refusal and the same warnings.

Where DeepSpeed is imported already (``--trials``, a second plan in one process), parsing
in-process costs nothing, and that is what happens. A process that cannot start, dies, or does not
answer within ``ANSWER_TIMEOUT_S`` is killed, and the config is parsed in-process instead, which
raises whatever it raises: the process only ever saves time. It never outlives the command: it
exits once it answers, is ended when the command ends without a config (an error, an interrupt:
:func:`stop_parser`, and at the interpreter's exit), and is killed by the kernel when the command
dies.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import ctypes
import importlib
import json
import os
import signal
import subprocess
import sys
import warnings
from typing import Any

from dsauto.emit.ds_config import validate_ds_config
from dsauto.errors import DsautoError, DsautoWarning

ANSWER_TIMEOUT_S = 120.0
"""How long the parser may take after it is handed the config (its import included, when it was
started late) before it is killed and the config parsed in-process."""

PARENT_VARIABLE = "DSAUTO_PARSER_PARENT"
"""The command's process id, which the parser process outlives by nothing (see :func:`serve`)."""
PATH_VARIABLE = "DSAUTO_PARSER_SYS_PATH"
"""The command's ``sys.path``, handed to the parser process so that it imports the same dsauto and
DeepSpeed (``python -c`` would put its working folder first)."""

_ENTRY = (f"import json, os, sys; sys.path[:] = json.loads(os.environ[{PATH_VARIABLE!r}]); "
          "from dsauto.emit.parser_process import serve; raise SystemExit(serve())")
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class ParserProcess:
    """A Python process importing DeepSpeed's config module, then parsing the one config it is sent."""

    def __init__(self) -> None:
        # Python's own warning options (-W, -X dev) too, so that the process's warnings pass the
        # same filters as this one's would.
        options = [f"-W{option}" for option in sys.warnoptions]
        debug = bool(os.environ.get("DSAUTO_DEBUG"))
        self._process = subprocess.Popen(  # raises OSError where no process can start
            [sys.executable, *options, "-c", _ENTRY], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=None if debug else subprocess.DEVNULL, text=True,
            env=dict(os.environ, **{PATH_VARIABLE: json.dumps(sys.path), PARENT_VARIABLE: str(os.getpid())}))

    def validate(self, config: dict[str, Any], dp: int) -> None:
        """What :func:`~dsauto.emit.ds_config.validate_ds_config` does with ``config`` on ``dp``
        ranks: the same DsautoError, the same warnings; parsed in-process if this process fails.
        The process is ended however this returns (an interrupt while waiting included)."""
        try:
            answer = self._ask(config, dp)
        finally:
            self.close()
        if answer is None:
            validate_ds_config(config, dp)
            return
        for warning in answer["warnings"]:
            if warning["dsauto"]:
                warnings.warn(warning["message"], DsautoWarning, stacklevel=3)
            else:  # DeepSpeed's or torch's own, as they would have said it here
                category = getattr(builtins, warning["category"], None)
                if not (isinstance(category, type) and issubclass(category, Warning)):
                    category = getattr(builtins, warning["builtin"], UserWarning)
                warnings.warn_explicit(warning["message"], category, warning["filename"], warning["lineno"],
                                       module=warning.get("module"))
        if answer["error"] is not None:
            raise DsautoError(answer["error"])

    def close(self) -> None:
        """Ends the process, answered or not."""
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        for stream in (self._process.stdin, self._process.stdout):
            if stream is not None:
                stream.close()

    def _ask(self, config: dict[str, Any], dp: int) -> dict[str, Any] | None:
        """The process's answer, or None when it gives none (the caller then parses in-process)."""
        try:
            request = json.dumps({"config": config, "dp": dp}) + "\n"
            out, _ = self._process.communicate(request, timeout=ANSWER_TIMEOUT_S)
            answer = json.loads(out.strip().splitlines()[-1]) if self._process.returncode == 0 else None
        except (subprocess.TimeoutExpired, OSError, TypeError, ValueError, IndexError):
            return None  # not JSON (the in-process parser then says why), killed, hung or silent
        return answer if isinstance(answer, dict) and {"error", "warnings"} <= set(answer) else None


_started: ParserProcess | None = None


def start_parser() -> None:
    """Starts the parser process, unless one is waiting or DeepSpeed is imported in this one; the
    next :func:`validate` hands it its config. ``dsauto tune`` calls it before its search."""
    global _started
    if _started is not None or "deepspeed" in sys.modules:
        return
    try:
        _started = ParserProcess()
    except OSError:
        return  # no process to spare: validate() parses in-process
    atexit.register(stop_parser)


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


def stop_parser() -> None:
    """Ends the process :func:`start_parser` started, if it waits still (a command that ends without
    writing a config: an error, an interrupt; and at the interpreter's exit)."""
    global _started
    parser, _started = _started, None
    if parser is not None:
        parser.close()


def serve() -> int:
    """The parser process: imports DeepSpeed's config module, reads one request from standard input,
    and writes the answer as one line of JSON to standard output; DeepSpeed's and torch's own prints
    go to standard error. Nothing to read (the command ended without a config) ends it quietly, and
    so does the command's death (Linux's parent-death signal)."""
    parent = int(os.environ.get(PARENT_VARIABLE, os.getppid()))
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        return 0  # the command died before the signal was armed
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
    modules = {getattr(module, "__file__", None): name for name, module in list(sys.modules.items())}
    said = [{"dsauto": issubclass(w.category, DsautoWarning), "category": w.category.__name__,
             "builtin": next((c.__name__ for c in w.category.__mro__ if getattr(builtins, c.__name__, None) is c),
                             "UserWarning"),
             "message": str(w.message), "filename": w.filename, "lineno": w.lineno,
             "module": modules.get(w.filename)} for w in caught]
    answer_to.write(json.dumps({"error": error, "warnings": said}) + "\n")
    answer_to.close()
    sys.stderr.flush()  # what DeepSpeed said, shown under DSAUTO_DEBUG
    os._exit(0)  # answered: no interpreter shutdown (torch's) for the command to wait through
