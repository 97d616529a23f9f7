"""Where a run lives: `<training.storage>/<run name>/`, like Ray Train's `storage_path/name`.

    run.json        name, fingerprint and training keys, written when the run first starts
    config.yaml     the resolved config of the latest start
    checkpoints/    step-00000050/ ... (CheckpointManager)
    hf_model/       the exported model
    summary.json    written last: the run is complete

The default MLflow store (no `tracking.tracking_uri`, no MLFLOW_TRACKING_URI) is `<storage>/mlflow.db`
with artifacts in `<storage>/mlartifacts/`, so nothing of a run is left in the working directory,
which under `ray job submit` is Ray's package folder and is deleted with the cluster.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from mt_ray.config.identity import RunIdentity, changed_keys, run_identity
from mt_ray.config.run import RunConfig
from mt_ray.errors import ConfigError
from mt_ray.tracking import CheckpointConfig, TrackingConfig
from mt_ray.tracking.run_files import RunFiles, open_run_files

RUN_FILE = "run.json"
CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
EXPORT_DIR = "hf_model"
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray's job supervisor for the entrypoint it starts


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

    def claim(self, cfg: RunConfig) -> None:
        """Refuse a different config under this run's name; record this one (`run.json` once, `config.yaml` always)."""
        recorded = self.files.read_text(RUN_FILE)
        if recorded is None:
            self.files.write_text(RUN_FILE, json.dumps(self.identity.to_json(), indent=2))
        else:
            check_same_run(RunIdentity.from_json(json.loads(recorded)), self.identity, f"{self.uri}/{RUN_FILE}")
        self.files.write_text(CONFIG_FILE, yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))

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
        "Give this config its own training.run_name (or leave it unset for a generated one), or delete that "
        "run's folder to start it over.")


def resolve_storage(storage: str) -> str:
    """`training.storage` as an absolute path or `s3://` URI; a relative path under a Ray job is refused."""
    if storage.startswith("s3://"):
        return storage.rstrip("/")
    path = Path(storage).expanduser()
    if not path.is_absolute() and in_ray_job():
        raise ConfigError(
            f"training.storage: '{storage}' is a relative path, and this is a Ray job, whose working directory is "
            f"Ray's copy of the package ({os.getcwd()}), deleted with the cluster. Give an absolute path that "
            "outlives the cluster (on every node, for several), or s3://bucket/prefix; submitting from this "
            "machine, e.g. training.storage=$PWD/runs")
    return str(path.resolve())


def in_ray_job() -> bool:
    """Whether this process is the entrypoint of a `ray job submit`."""
    return RAY_JOB_ENV in os.environ


def run_tracking_config(tracking: TrackingConfig, name: str, root: str) -> TrackingConfig:
    """The run's MLflow settings: named after the run; with no store given, the store in the storage root."""
    update: dict[str, Any] = {"run_name": name}
    if tracking.enabled and tracking.tracking_uri is None and not os.environ.get("MLFLOW_TRACKING_URI"):
        if not root.startswith("s3://"):
            update["tracking_uri"] = f"sqlite:///{root}/mlflow.db"
            update["artifact_location"] = tracking.artifact_location or f"{root}/mlartifacts"
        elif in_ray_job():
            raise ConfigError(
                "tracking.tracking_uri: this Ray job stores the run on S3, and MLflow's default store would be "
                "a file in Ray's package folder, deleted with the cluster; set tracking.tracking_uri (or "
                "MLFLOW_TRACKING_URI) to a tracking server, or tracking.enabled=false")
    return tracking.model_copy(update=update)
