"""Launch a training script under DeepSpeed's autotuner when the script reads its config file itself.

DeepSpeed's autotuner starts every experiment as
``deepspeed ... <user_script> --deepspeed_config <BASE64>``: it replaces the config path by the
experiment's config, base64-encoded (deepspeed/autotuning/scheduler.py, ``run_experiment``).
``deepspeed.initialize`` decodes that, but a script that opens ``args.deepspeed_config`` itself
(as ``examples/deepspeed/train_gpt.py`` does) fails with ``OSError: File name too long``. This
shim is the autotuner's user script instead:

    deepspeed --autotuning tune --include localhost:0,1 benchmarks/ds_autotuner_shim.py \\
        examples/deepspeed/train_gpt.py --deepspeed_config cfg.json --steps 6

Each rank runs ``python ds_autotuner_shim.py --local_rank=N <script> <args...>``; the shim writes a
base64 ``--deepspeed_config`` value to a temporary JSON file, puts its path in its place, and runs
``<script> --local_rank=N <args...>`` in this process (``runpy``), as if launched directly.
"""

from __future__ import annotations

import atexit
import base64
import json
import os
import runpy
import sys
import tempfile

CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed")


def decoded_config_path(value: str) -> str:
    """``value`` when it names a file, else the path of a temporary JSON file holding its base64 config."""
    if os.path.exists(value):
        return value
    config = json.loads(base64.urlsafe_b64decode(value).decode("utf-8"))
    fd, path = tempfile.mkstemp(prefix="ds_autotuner_exp_", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(config, f)
    atexit.register(lambda: os.path.exists(path) and os.remove(path))
    return path


def main(argv: list[str]) -> None:
    launcher_args = [a for a in argv if a.startswith("--local_rank=")]
    rest = [a for a in argv if not a.startswith("--local_rank=")]
    if not rest:
        sys.exit("usage: ds_autotuner_shim.py [--local_rank=N] SCRIPT [ARGS...]")
    script, script_args = rest[0], rest[1:]
    for i, arg in enumerate(script_args[:-1]):
        if arg in CONFIG_FLAGS:
            script_args[i + 1] = decoded_config_path(script_args[i + 1])
            break
    sys.argv = [script, *launcher_args, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
