"""Checks run before any model or data work: the run's outputs can be written, found out within seconds.

The storage root (`training.storage`) gets a probe file written and removed; the MLflow store is opened and
written once, whatever its kind (a SQLite file takes a write lock; a file store's folder gets a probe file; a
server or any other store is asked for the run's experiment, created when missing) with MLflow's HTTP retries
off and a short timeout. A failure is one `ConfigError` naming the key
and the fix, instead of minutes of retries and a traceback after the model has loaded.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path

from mt_ray.config.run import RunConfig
from mt_ray.errors import ConfigError, MtRayError
from mt_ray.tracking import MlflowTracker, TrackingConfig
from mt_ray.tracking.run_files import open_run_files
from mt_ray.tracking.stores import ALLOW_FILE_STORE_ENV, file_store_path, file_store_refused
from mt_ray.training.run_dir import RunDir

CHECK_TIMEOUT_S = 10
_PROBE = ".mt-ray-write-check"
_NO_TRACKING = "or set tracking.enabled=false"


def check_outputs(cfg: RunConfig, run: RunDir) -> None:
    """Refuse, in one line, a storage root or MLflow store this run could not write."""
    check_storage(cfg, run.root)
    if cfg.tracking.enabled:
        key = ("tracking.tracking_uri" if cfg.tracking.tracking_uri else
               "MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "training.storage")
        check_tracking(run.tracking_config, key)


def check_storage(cfg: RunConfig, root: str) -> None:
    """Write and remove a probe file under the storage root (created if missing; the run's folder is not)."""
    name = f"{_PROBE}-{uuid.uuid4().hex[:8]}"
    try:
        if not root.startswith("s3://"):
            Path(root).mkdir(parents=True, exist_ok=True)
        files = open_run_files(root, cfg.checkpoint)
        files.write_text(name, "")
        files.remove(name)
    except (OSError, MtRayError) as e:  # an S3 failure is a CheckpointError saying what and where
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"training.storage: cannot write to {root} ({why}); point training.storage at a writable "
                          "folder, or s3://bucket/prefix") from None


def check_tracking(tracking: TrackingConfig, key: str) -> None:
    """Open the MLflow store and write to it once, within `CHECK_TIMEOUT_S`, whatever its kind."""
    uri = tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri:
        return  # MLflow's own default store; an mt-ray run always names one (`run_dir.tracking_store_uri`)
    if uri.startswith("sqlite:///"):
        _check_sqlite(Path(uri.removeprefix("sqlite:///")), uri, key)
    elif (folder := file_store_path(uri)) is not None:
        _check_file_store(Path(folder), uri, key)
    else:
        _check_server(tracking, uri, key)


def _check_sqlite(path: Path, uri: str, key: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.closing(sqlite3.connect(path, timeout=CHECK_TIMEOUT_S)) as db:
            db.execute("BEGIN IMMEDIATE")  # the write lock: refused on a read-only file or filesystem
            db.rollback()
    except (OSError, sqlite3.Error) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"{key}: the MLflow store {uri} cannot be written ({why}); use a writable path, a tracking "
                          f"server (http://host:5000), {_NO_TRACKING}") from None


def _check_file_store(folder: Path, uri: str, key: str) -> None:
    """A file store's folder gets a probe file written and removed; MLflow opens it (`stores.allow_file_store`)
    unless the user turned it off."""
    if file_store_refused():
        raise ConfigError(f"{key}: {uri} is MLflow's file store, which {ALLOW_FILE_STORE_ENV}="
                          f"{os.environ[ALLOW_FILE_STORE_ENV]} turns off; unset {ALLOW_FILE_STORE_ENV}, or use "
                          f"sqlite:///{folder}/mlflow.db, {_NO_TRACKING}")
    probe = folder / f"{_PROBE}-{uuid.uuid4().hex[:8]}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{key}: the MLflow store {uri} cannot be written ({e.strerror or e}); use a writable "
                          f"path, a tracking server (http://host:5000), {_NO_TRACKING}") from None


def _check_server(tracking: TrackingConfig, uri: str, key: str) -> None:
    """A server, or any other store MLflow knows (a database, Databricks): asked for the run's experiment.

    Whatever stops MLflow opening it (no such scheme, a missing database driver, no answer) is the first line
    of its error."""
    kind = "server" if uri.startswith(("http://", "https://")) else "store"
    try:
        with _bounded_requests():
            MlflowTracker(tracking).experiment_id()
    except Exception as e:  # any failure to open the store is the one line this check gives
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{key}: cannot reach the MLflow {kind} {uri} (no retries, {CHECK_TIMEOUT_S} s timeout: "
                          f"{why}); start it or fix the URI, {_NO_TRACKING}") from None


@contextlib.contextmanager
def _bounded_requests() -> Iterator[None]:
    """MLflow's HTTP requests without retries and with a short timeout, for the duration of the check."""
    bounds = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(CHECK_TIMEOUT_S)}
    saved = {k: os.environ.get(k) for k in bounds}
    os.environ.update(bounds)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
