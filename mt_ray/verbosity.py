"""How much the libraries a run drives may print: warnings and errors only, unless `MT_RAY_VERBOSE=1`.

MLflow's database set-up and system-metrics notices and Ray's start-up lines are INFO logs that bury a run's own
output; every layer reads the switch here (the root of the package, below them all)."""

from __future__ import annotations

import logging
import os
import sys

VERBOSE_ENV = "MT_RAY_VERBOSE"
_CHATTY = ("mlflow", "alembic", "ray", "filelock", "urllib3", "botocore")
# Notices logged as warnings: Ray 2.60's that it turned token authentication on for the Ray a run starts for itself
# (its default; `ray start`'s warning that authentication is off comes from another process).
_NOTICES = ("ray._private.authentication.authentication_token_setup",)


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0", "false")


def library_log_level() -> int:
    """The level the libraries log at: INFO when verbose, else WARNING (also Ray's `logging_level`)."""
    return logging.INFO if verbose() else logging.WARNING


def quiet_libraries() -> None:
    """Set the chatty libraries' loggers to `library_log_level` (MLflow, which sets its own level when imported,
    through its MLFLOW_LOGGING_LEVEL), keep the notices out, and Ray's colour codes out of a log that is not a
    terminal (`RAY_COLOR_PREFIX=0`: its worker lines' prefixes, read as it prints them)."""
    if not verbose():
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    for name in _CHATTY:
        logging.getLogger(name).setLevel(library_log_level())
    for name in _NOTICES:
        logging.getLogger(name).setLevel(logging.INFO if verbose() else logging.ERROR)
