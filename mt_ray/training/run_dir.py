"""Where a run lives: `<training.storage>/<run name>/`, like Ray Train's `storage_path/name`.

    run.json        name, fingerprint and training keys, written when the run first starts
    config.yaml     the resolved config of the latest start
    checkpoints/    step-00000050/ ... (CheckpointManager)
    hf_model/       the exported model
    summary.json    written last: the run is complete

The default MLflow store (no `tracking.tracking_uri`, no MLFLOW_TRACKING_URI) is `<storage>/mlflow.db`
with artifacts in `<storage>/mlartifacts/`, so nothing of a run is left in the working directory,
which under `ray job submit` is Ray's package folder and is deleted with the cluster.

Relative paths the run writes to (storage, a local MLflow store, artifact locations) are made
absolute here, against the directory the command was launched from, before a sweep's trials (each
in a folder of Ray's) get the config; under a Ray job they are refused (`resolve_local`).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from mt_ray.config.identity import RunIdentity, changed_keys, run_identity
from mt_ray.config.run import RunConfig
from mt_ray.errors import ConfigError
from mt_ray.tracking import CheckpointConfig, TrackingConfig
from mt_ray.tracking.run_files import RunFiles, open_run_files
from mt_ray.tracking.stores import local_store_path

RUN_FILE = "run.json"
CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
EXPORT_DIR = "hf_model"
# How to name a run apart, in both vocabularies: a LLaMA-Factory file names the run by its output_dir.
ANOTHER_NAME = "another training.run_name (in a LLaMA-Factory file, another output_dir)"
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray's job supervisor for the entrypoint it starts
_SERVER = "a tracking server (http://host:5000), or for artifacts s3://bucket/prefix"  # not a local path


class RunDir:
    """A run's identity and directory; `files` is the seam for another backend."""

    def __init__(self, cfg: RunConfig, files: RunFiles | None = None):
        self.identity: RunIdentity = run_identity(cfg)
        self.root = resolve_storage(cfg.training.storage)
        self.uri = f"{self.root}/{self.identity.name}"
        self.checkpoint_config: CheckpointConfig = cfg.checkpoint.model_copy(update={"uri": f"{self.uri}/checkpoints"})
        self.tracking_config: TrackingConfig = run_tracking_config(cfg.tracking, self.identity.name, self.root)
        self.files = files if files is not None else open_run_files(self.uri, cfg.checkpoint)

    @property
    def name(self) -> str:
        return self.identity.name

    @property
    def staging(self) -> Path:
        """Local folder the exported model is written to before `publish` (the run folder itself on disk)."""
        return self.files.staging

    def check(self) -> None:
        """Refuse a different config under this run's name (writes nothing: a run claims its name at its first step)."""
        recorded = self.files.read_text(RUN_FILE)
        if recorded is not None:
            check_same_run(RunIdentity.from_json(json.loads(recorded)), self.identity, f"{self.uri}/{RUN_FILE}")

    def claim(self, cfg: RunConfig) -> None:
        """Record this run under its name as its first step is about to run (`run.json` once, `config.yaml`
        always): a run that fails before then leaves nothing behind."""
        self.check()
        if self.files.read_text(RUN_FILE) is None:
            self.files.write_text(RUN_FILE, json.dumps(self.identity.to_json(), indent=2))
        self.files.write_text(CONFIG_FILE, cfg.to_yaml())

    def release(self) -> None:
        """Give the name back (a run that failed before finishing its first step, with no checkpoint): its
        `run.json` and `config.yaml` go, and its local folder too once nothing else is in it."""
        for name in (CONFIG_FILE, RUN_FILE):
            self.files.remove(name)
        if not self.uri.startswith("s3://"):
            with contextlib.suppress(OSError):
                Path(self.uri).rmdir()

    def read_summary(self) -> dict[str, Any] | None:
        """The finished run's summary, or None while the run is not complete."""
        text = self.files.read_text(SUMMARY_FILE)
        return json.loads(text) if text is not None else None

    def write_summary(self, summary: dict[str, Any]) -> None:
        self.files.write_text(SUMMARY_FILE, json.dumps(summary, indent=2, default=str))

    def publish(self, name: str) -> str:
        """Make `staging / name` durable in the run directory; returns its URI there."""
        self.files.publish(name)
        return f"{self.uri}/{name}"

    def close(self) -> None:
        self.files.close()


def check_same_run(recorded: RunIdentity, current: RunIdentity, where: str) -> None:
    """A run's training keys never change under its name: refuse with the keys that did."""
    if recorded.fingerprint == current.fingerprint:
        return
    changes = "\n  ".join(changed_keys(recorded.keys, current.keys))
    raise ConfigError(
        f"run '{current.name}' was started with another config ({where}); changed keys:\n  {changes}\n"
        f"Give this config {ANOTHER_NAME} (or leave it unset for a generated one), or delete that run's folder "
        "to start it over.")


def resolve_storage(storage: str, key: str = "training.storage") -> str:
    """A storage root (`key`) as an absolute path or `s3://` URI; a relative path under a Ray job is refused."""
    if storage.startswith("s3://"):
        return storage.rstrip("/")
    return resolve_local(storage, key, f"{key}=$PWD/{storage}", "s3://bucket/prefix")


def resolve_local(path: str, key: str, absolute_form: str, remote_form: str) -> str:
    """`path` made absolute against the directory the command was launched from, before anything copies it.

    A sweep's trials and a Ray job's processes each run in a folder of Ray's (under a Ray job, the
    launch directory itself is Ray's copy of the package, deleted with the cluster), so a relative
    path means another place there. Under a Ray job it is refused, naming `key`, `absolute_form` and
    `remote_form` (a store that is not a local path).
    """
    expanded = Path(path).expanduser()
    if not expanded.is_absolute() and in_ray_job():
        raise ConfigError(
            f"{key}: '{path}' is a relative path, and this is a Ray job, whose working directory is Ray's copy "
            f"of the package ({os.getcwd()}), deleted with the cluster. Give an absolute path that outlives the "
            f"cluster (on every node, for several), or {remote_form}; submitting from this "
            f"machine, e.g. {absolute_form}")
    return str(expanded.resolve())


def resolve_tracking_uri(uri: str, key: str) -> str:
    """An MLflow store or artifact URI (`key`) with a relative local path made absolute (see `resolve_local`).

    Servers and remote stores (`http://`, `s3://`, `databricks`...) are returned as they are.
    """
    local = local_store_path(uri)
    if local is None:
        return uri
    prefix, path = local
    return prefix + resolve_local(path, key, f"{key}={prefix}$PWD/{path}", _SERVER)


def in_ray_job() -> bool:
    """Whether this process is the entrypoint of a `ray job submit`."""
    return RAY_JOB_ENV in os.environ


def run_tracking_config(tracking: TrackingConfig, name: str, root: str) -> TrackingConfig:
    """The run's MLflow settings: named after the run, its store's local paths absolute (`resolve_tracking_uri`).

    A local SQLite store keeps its artifacts beside its database, in `mlartifacts/`, unless
    `tracking.artifact_location` says otherwise: MLflow's own default, `./mlruns`, is a folder in
    whichever directory the process happens to start in (a sweep trial's, Ray's package folder).
    """
    if not tracking.enabled:
        return tracking.model_copy(update={"run_name": name})
    uri = tracking_store_uri(tracking, root)
    local = local_store_path(uri) if uri is not None else None
    artifacts = tracking.artifact_location
    if artifacts is not None:
        artifacts = resolve_tracking_uri(artifacts, "tracking.artifact_location")
    elif local is not None and local[0] == "sqlite:///":
        artifacts = f"{Path(local[1]).parent}/mlartifacts"
    return tracking.model_copy(update={"run_name": name, "tracking_uri": uri, "artifact_location": artifacts})


def tracking_store_uri(tracking: TrackingConfig, root: str) -> str | None:
    """The store the run logs to; None leaves MLflow to read a server's URI from MLFLOW_TRACKING_URI.

    With no store given, it is `<root>/mlflow.db`; with the root on S3, MLflow's own default
    (`./mlflow.db`), made absolute here, since a Ray job's working directory is deleted with its cluster.
    """
    if tracking.tracking_uri is not None:
        return resolve_tracking_uri(tracking.tracking_uri, "tracking.tracking_uri")
    if env := os.environ.get("MLFLOW_TRACKING_URI"):
        resolved = resolve_tracking_uri(env, "MLFLOW_TRACKING_URI")
        # A local store is pinned, absolute; a server's URI stays in the environment (it may hold credentials).
        return resolved if local_store_path(resolved) is not None else None
    if not root.startswith("s3://"):
        return f"sqlite:///{root}/mlflow.db"
    if in_ray_job():
        raise ConfigError(
            "tracking.tracking_uri: this Ray job stores the run on S3, and MLflow's default store would be "
            "a file in Ray's package folder, deleted with the cluster; set tracking.tracking_uri (or "
            "MLFLOW_TRACKING_URI) to a tracking server, or tracking.enabled=false")
    return resolve_tracking_uri("sqlite:///mlflow.db", "tracking.tracking_uri")
