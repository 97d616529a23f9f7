"""How much the libraries a run drives may print: warnings and errors only, unless `MT_RAY_VERBOSE=1`.

MLflow's database set-up and system-metrics notices and Ray's start-up lines are INFO logs that bury a run's own
output; every layer reads the switch here (the root of the package, below them all)."""

from __future__ import annotations

import logging
import os

VERBOSE_ENV = "MT_RAY_VERBOSE"
_CHATTY = ("mlflow", "alembic", "ray", "filelock", "urllib3", "botocore")


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0", "false")


def library_log_level() -> int:
    """The level the libraries log at: INFO when verbose, else WARNING (also Ray's `logging_level`)."""
    return logging.INFO if verbose() else logging.WARNING


def quiet_libraries() -> None:
    """Set the chatty libraries' loggers to `library_log_level` (MLflow, which sets its own level when imported,
    through its MLFLOW_LOGGING_LEVEL)."""
    if not verbose():
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    for name in _CHATTY:
        logging.getLogger(name).setLevel(library_log_level())
