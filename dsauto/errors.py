"""The one exception type a user can cause.

Every error a user can provoke (a bad file, an impossible budget, a TP degree that does not divide
the heads) is raised as :class:`DsautoError` with one sentence that carries the numbers and says
what to change. The CLI prints that sentence and exits with code 2; nothing else is shown.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


class DsautoError(Exception):
    """A user-facing error: its message is one complete sentence, printed as is."""


class DsautoWarning(UserWarning):
    """Something dsauto read but could not take into account (an unknown key of a Hugging Face
    config); the CLI prints it as ``dsauto: warning: <sentence>``."""


def run_script(main: Callable[[], object], script: str) -> None:
    """Runs a training script's ``main``; a refusal of dsauto's (the plan does not fit the launch)
    prints as one line, ``<script>: error (rank R): <sentence>``, and exits with code 2 instead of a
    traceback on every rank."""
    try:
        main()
    except DsautoError as exc:
        print(f"{os.path.basename(script)}: error (rank {os.environ.get('RANK', '0')}): {exc}", file=sys.stderr)
        sys.exit(2)
