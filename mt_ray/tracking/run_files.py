"""A run directory's own files, on local disk or S3: `run.json`, `config.yaml`, `summary.json`, `hf_model/`.

Checkpoints live beside them (`checkpoints/`, written by ``CheckpointManager``). Small files are
written whole or not at all: locally to a temporary name that is then renamed, on S3 as one PUT.
Larger outputs (the exported model) are written first to ``staging``, a local folder (the run
directory itself on local disk, a temporary folder for S3), and ``publish`` makes them durable.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from mt_ray.tracking.ckpt_config import CheckpointConfig


class RunFiles(Protocol):
    """The files of one run directory at ``uri``."""

    uri: str
    staging: Path
    """Local folder outputs are written to before ``publish``."""

    def read_text(self, name: str) -> str | None:
        """A file's text, or ``None`` when it does not exist."""
        ...

    def write_text(self, name: str, text: str) -> None:
        """Store a small file, replacing it whole."""
        ...

    def publish(self, name: str) -> None:
        """Make ``staging / name`` (a file or folder) durable in the run directory."""
        ...

    def remove(self, name: str) -> None:
        """Delete a small file, if it is there."""
        ...

    def close(self) -> None:
        """Remove what staging holds that the run directory does not need."""
        ...


def open_run_files(uri: str, config: CheckpointConfig) -> RunFiles:
    """S3 for ``s3://`` (with the S3 settings of the ``checkpoint`` section), else a local folder."""
    if uri.startswith("s3://"):
        return S3RunFiles(uri, config)
    return LocalRunFiles(Path(uri))


class LocalRunFiles:
    """A run folder on local (or network-mounted) disk; outputs are written in place."""

    def __init__(self, root: Path):
        self.root = root
        self.uri = str(root)
        self.staging = root

    def read_text(self, name: str) -> str | None:
        path = self.root / name
        return path.read_text() if path.is_file() else None

    def write_text(self, name: str, text: str) -> None:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: readers see the old file or the new one, never half of one

    def publish(self, name: str) -> None:
        """Nothing to do: outputs were written into the run folder itself."""

    def remove(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def close(self) -> None: ...


class S3RunFiles:
    """A run directory under ``s3://bucket/prefix``; the exported model is staged in a local temporary folder."""

    def __init__(self, uri: str, config: CheckpointConfig, client=None):
        from mt_ray.tracking.ckpt_s3 import build_s3_client, split_s3_uri

        self.uri = uri.rstrip("/")
        self.bucket, self.prefix = split_s3_uri(self.uri)
        self.client = client if client is not None else build_s3_client(config)
        self.config = config
        self.staging = Path(tempfile.mkdtemp(prefix="mt-ray-run-"))

    def read_text(self, name: str) -> str | None:
        from botocore.exceptions import ClientError

        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"]
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise self._error(e, f"reading {self.uri}/{name}") from None
        with body:
            return body.read().decode()

    def write_text(self, name: str, text: str) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(name), Body=text.encode())
        except Exception as e:
            raise self._error(e, f"writing {self.uri}/{name}") from None

    def publish(self, name: str) -> None:
        from boto3.s3.transfer import TransferConfig

        local = self.staging / name
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        transfer = TransferConfig(multipart_threshold=self.config.multipart_threshold_bytes,
                                  multipart_chunksize=self.config.multipart_chunk_bytes,
                                  max_concurrency=self.config.max_concurrency)
        for path in files:
            rel = path.relative_to(self.staging).as_posix()
            try:
                self.client.upload_file(str(path), self.bucket, self._key(rel), Config=transfer)
            except Exception as e:
                raise self._error(e, f"uploading {self.uri}/{rel}") from None

    def remove(self, name: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(name))
        except Exception as e:
            raise self._error(e, f"deleting {self.uri}/{name}") from None

    def close(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _error(self, e: Exception, what: str) -> Exception:
        from mt_ray.tracking.ckpt_s3 import s3_error

        return s3_error(e, what, self.bucket, self.config.endpoint_url or "AWS")
