"""Where a sweep keeps its state: Tune's experiment, every trial's outputs, the sweep's record and best config.

Everything lives under `<storage>/<name>/`, a local folder or `s3://bucket/prefix` (the checkpoint
store, reached with the run config's `checkpoint.endpoint_url` and `region`):

    <storage>/<name>/            Tune's experiment state (what `--resume` restores)
        sweep.json               the base config, the space and the sweep's MLflow run id
        best_config.yaml         the best trial's run config, ready for `mt-ray train --config`
        trials/<name>-<trial id>/  each trial's run folder (checkpoints, summary, export: see RunDir)
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

from mt_ray.errors import ConfigError
from mt_ray.tracking import CheckpointConfig
from mt_ray.training.run_dir import resolve_storage

RECORD = "sweep.json"
BEST_CONFIG = "best_config.yaml"


class SweepStorage:
    """The sweep's folder on a local disk or S3, checked writable before anything runs."""

    def __init__(self, storage: str, name: str, checkpoint: CheckpointConfig):
        self.is_s3 = storage.startswith("s3://")
        self.root = root = resolve_storage(storage)
        self.name = name
        self.uri = f"{root}/{name}"  # the experiment folder, as a URI
        self.filesystem = _s3_filesystem(checkpoint) if self.is_s3 else None
        self._check_writable()

    @property
    def tune_storage_path(self) -> str:
        """Tune's `storage_path`: the bucket path without the scheme when a filesystem is given."""
        return self.root.removeprefix("s3://") if self.is_s3 else self.root

    @property
    def trials_uri(self) -> str:
        """The trials' storage root: each trial is a run in a folder of its own there."""
        return f"{self.uri}/trials"

    def read_record(self) -> dict[str, Any] | None:
        """The sweep's record, or None when no sweep of this name was started here."""
        try:
            return json.loads(self._read(RECORD))
        except FileNotFoundError:
            return None

    def write_record(self, record: dict[str, Any]) -> None:
        self.write(RECORD, json.dumps(record, indent=2, default=str))

    def write(self, name: str, text: str) -> str:
        """Write `name` in the sweep's folder whole (a temporary name, then a rename; S3 puts are whole) and return its URI."""
        if self.filesystem is not None:
            with self.filesystem.open_output_stream(f"{self.tune_storage_path}/{self.name}/{name}") as f:
                f.write(text.encode())
        else:
            path = Path(self.uri) / name
            tmp = path.with_name(f".{name}.{uuid.uuid4().hex}")
            tmp.write_text(text)
            os.replace(tmp, path)
        return f"{self.uri}/{name}"

    def _read(self, name: str) -> str:
        if self.filesystem is not None:
            from pyarrow.fs import FileType

            path = f"{self.tune_storage_path}/{self.name}/{name}"
            if self.filesystem.get_file_info(path).type == FileType.NotFound:
                raise FileNotFoundError(path)
            with self.filesystem.open_input_stream(path) as f:
                return f.read().decode()
        return (Path(self.uri) / name).read_text()

    def _check_writable(self) -> None:
        probe = f".write-test-{uuid.uuid4().hex}"
        try:
            if self.filesystem is None:
                Path(self.uri).mkdir(parents=True, exist_ok=True)
            self.write(probe, "")
            self._delete(probe)
        except OSError as e:
            raise ConfigError(f"sweep storage {self.uri} is not writable ({e}); pass a --storage folder you can write "
                              "to, or s3://bucket/prefix") from None

    def _delete(self, name: str) -> None:
        if self.filesystem is not None:
            self.filesystem.delete_file(f"{self.tune_storage_path}/{self.name}/{name}")
        else:
            (Path(self.uri) / name).unlink()


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
