"""The first second of a command that trains: a line saying it started, because importing torch, transformers
and Ray takes seconds before anything else can be said; and Ctrl-C at any moment outside a run (during those
imports, while the config loads, while Ray stops) ending it in one line, exit status 130, not a traceback from
inside an import. A run's own interrupt line comes from `training.launch.run_from_command_line`.

This module imports nothing heavy: the entry points call it before their own imports.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C ended


def run_quietly(command: str, body: Callable[[], int], announce: bool = True) -> int:
    """`body()`'s exit status, after a line saying `command` started (`announce`); a KeyboardInterrupt that reaches
    the entry point is one line and `INTERRUPTED`. The line is printed inside the guard, so Ctrl-C at any moment
    after it is seen is caught."""
    try:
        if announce:
            print(f"{command}: starting (loading torch and transformers)", flush=True)
        return body()
    except KeyboardInterrupt:
        print(f"{command}: interrupted before the run started or after it ended", file=sys.stderr, flush=True)
        return INTERRUPTED
