"""Which kind of MLflow store a tracking URI names, and MLflow's opt-in for its file store.

MLflow 3.17 keeps its file store (`file:mlruns`, `file:///abs/mlruns`, a bare path) in maintenance mode: its
`FileStore` refuses to open unless `MLFLOW_ALLOW_FILE_STORE` is true, the opt-out MLflow's own message names
for a workflow that needs that backend. A user who names a file store has chosen it, so a run turns MLflow's
opt-out on for itself (`allow_file_store`) instead of crashing after the model has loaded; a
`MLFLOW_ALLOW_FILE_STORE` the user set to false is kept, and the run is refused up front (`training.preflight`).
"""

from __future__ import annotations

import os
from urllib.parse import urlparse

ALLOW_FILE_STORE_ENV = "MLFLOW_ALLOW_FILE_STORE"  # MLflow's own variable (mlflow.environment_variables)


def local_store_path(uri: str) -> tuple[str, str] | None:
    """`(prefix, path)` of a local MLflow URI (`sqlite:///<path>`, `file:<path>`, a bare path); None for others."""
    if uri.startswith("sqlite:///") and uri != "sqlite:///:memory:":
        return "sqlite:///", uri.removeprefix("sqlite:///")
    if uri.startswith("file:///") or (uri.startswith("file:") and not uri.startswith("file://")):
        return "file://", uri.removeprefix("file://" if uri.startswith("file:///") else "file:")
    # No scheme is a local path to MLflow, but for its Databricks names (`databricks`, `databricks-uc`).
    if not urlparse(uri).scheme and not uri.startswith("databricks"):
        return "", uri
    return None


def file_store_path(uri: str | None) -> str | None:
    """The folder of an MLflow file store URI; None for any other store."""
    local = local_store_path(uri) if uri else None
    return local[1] if local is not None and local[0] != "sqlite:///" else None


def file_store_refused() -> bool:
    """Whether the user turned MLflow's file store off (`MLFLOW_ALLOW_FILE_STORE` set to a false value)."""
    value = os.environ.get(ALLOW_FILE_STORE_ENV)
    return value is not None and value.strip().lower() not in ("true", "1")


def allow_file_store(uri: str | None) -> None:
    """Let MLflow open the file store `uri` names (in this process and those it starts); other stores: nothing."""
    if file_store_path(uri) is not None:
        os.environ.setdefault(ALLOW_FILE_STORE_ENV, "true")
