"""Where a sweep keeps its state: Tune's experiment, every trial's run, the sweep's record and best config.

Everything lives under `<storage>/<name>/`, a local folder or `s3://bucket/prefix` (the checkpoint
store, reached with the run config's `checkpoint` S3 settings):

    <storage>/<name>/              Tune's experiment state (what `--resume` restores)
        .mt-ray-sweep              written first: proves the storage is writable
        sweep.json                 the base config, the space and the sweep's MLflow run id
        best_config.yaml           the best trial's run config, ready for `mt-ray train --config`
        trials/<name>-<trial id>/  each trial's run folder (checkpoints, summary, export: see RunDir)

The sweep's own files go through the run folders' `RunFiles` (boto3 on S3); Tune writes its state
through pyarrow's filesystem, given the same endpoint and region.
"""

from __future__ import annotations

import json
import os
from typing import Any

from mt_ray.errors import ConfigError, MtRayError
from mt_ray.tracking import CheckpointConfig
from mt_ray.tracking.run_files import open_run_files
from mt_ray.training.run_dir import resolve_storage

RECORD = "sweep.json"
BEST_CONFIG = "best_config.yaml"
MARKER = ".mt-ray-sweep"


class SweepStorage:
    """The sweep's folder on a local disk or S3, checked writable before anything runs."""

    def __init__(self, storage: str, name: str, checkpoint: CheckpointConfig):
        self.is_s3 = storage.startswith("s3://")
        self.root = resolve_storage(storage, "--storage")  # Tune's storage_path
        self.name = name
        self.uri = f"{self.root}/{name}"  # the experiment folder, as a URI
        self.filesystem = _s3_filesystem(checkpoint) if self.is_s3 else None
        self.files = open_run_files(self.uri, checkpoint)
        try:
            self.files.write_text(MARKER, "a Ray Tune sweep of mt-ray runs\n")
        except (OSError, MtRayError) as e:
            raise ConfigError(f"sweep storage {self.uri} is not writable ({e}); pass a --storage folder you can write "
                              "to, or s3://bucket/prefix") from None

    @property
    def tune_storage_path(self) -> str:
        """Tune's `storage_path`: the bucket path without the scheme when a filesystem is given."""
        return self.root.removeprefix("s3://")

    @property
    def trials_uri(self) -> str:
        """The trials' storage root: each trial is a run in a folder of its own there."""
        return f"{self.uri}/trials"

    def read_record(self) -> dict[str, Any] | None:
        """The sweep's record, or None when no sweep of this name was started here."""
        text = self.files.read_text(RECORD)
        return json.loads(text) if text is not None else None

    def write_record(self, record: dict[str, Any]) -> None:
        self.files.write_text(RECORD, json.dumps(record, indent=2, default=str))

    def write(self, name: str, text: str) -> str:
        """Write `name` in the sweep's folder, whole; returns its URI."""
        self.files.write_text(name, text)
        return f"{self.uri}/{name}"


def _s3_filesystem(checkpoint: CheckpointConfig):
    """pyarrow's S3 filesystem (Tune's own) at the checkpoint store's endpoint and region."""
    from pyarrow.fs import S3FileSystem

    endpoint = checkpoint.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    kwargs: dict[str, Any] = {}
    if endpoint:
        kwargs["endpoint_override"] = endpoint
        kwargs["scheme"] = "http" if endpoint.startswith("http://") else "https"
    if checkpoint.region:
        kwargs["region"] = checkpoint.region
    return S3FileSystem(**kwargs)
