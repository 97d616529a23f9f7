"""``CheckpointManager``: save and restore ``(tensors, meta)`` on local disk or S3.

The API knows nothing of the trainer: a checkpoint is a dict of CPU tensors (the engine's flat
fp32 buffers plus any small extras) and a JSON-able ``meta`` dict. Typical use::

    ckpt = CheckpointManager(CheckpointConfig(uri="s3://bucket/run1", every_steps=500))
    if ckpt.latest() is not None:                       # resume
        tensors, _ = engine.checkpoint_state()          # the live buffers, to load into in place
        tensors, meta = ckpt.load(out=tensors)
        engine.load_checkpoint_state(tensors, meta)
    ...
    if ckpt.config.should_save(step):
        tensors, meta = engine.checkpoint_state()
        ckpt.save(step, tensors, meta)

See ``ckpt_format`` for the layout on disk and ``ckpt_storage`` / ``ckpt_s3`` for the backends.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from mt_ray.errors import CheckpointError
from mt_ray.tracking.ckpt_format import (
    MANIFEST_NAME,
    CheckpointCorruptedError,
    FileRecord,
    Manifest,
    ShardSource,
    check_meta,
    check_out_buffer,
    empty_tensor,
    parse_step,
    plan_shards,
    read_shard_into,
    step_dir_name,
)
from mt_ray.tracking.ckpt_storage import CheckpointStorage, CheckpointWriter, LocalStorage

logger = logging.getLogger(__name__)


class CheckpointConfig(BaseModel):
    """Where and how often checkpoints are written. Unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    uri: str = "runs/checkpoints"
    """A local directory, or ``s3://bucket/prefix`` for S3 (or any S3-compatible store)."""

    every_steps: int | None = Field(default=1000, ge=1)
    """Save every this many optimizer steps (see ``should_save``); ``None`` = only when asked."""

    keep_last: int | None = Field(default=3, ge=1)
    """Complete checkpoints kept; older ones are deleted after a new one is complete. ``None`` keeps all."""

    shard_bytes: int = Field(default=2 << 30, ge=1)
    """Largest shard file; bigger tensors are cut into pieces. Smaller shards spread over more workers."""

    io_workers: int = Field(default=4, ge=1)
    """Shard files written or read at once (threads; hashing and I/O release the GIL)."""

    endpoint_url: str | None = None
    """S3 endpoint for non-AWS stores (MinIO, Ceph, a local test server); ``None`` = AWS."""

    region: str | None = None
    """S3 region; ``None`` = boto3's default chain (``AWS_REGION``, the profile)."""

    aws_profile: str | None = None
    """Named profile in ``~/.aws/credentials``; ``None`` = boto3's default chain (env vars, profile, role)."""

    multipart_threshold_bytes: int = Field(default=64 << 20, ge=5 << 20)
    """Files at least this large are uploaded in parts (S3 parts are at least 5 MiB)."""

    multipart_chunk_bytes: int = Field(default=64 << 20, ge=5 << 20)
    """Size of each uploaded part."""

    max_concurrency: int = Field(default=8, ge=1)
    """Parts of one file in flight at once; memory in flight is about io_workers x 10 x chunk."""

    retries: int = Field(default=5, ge=1)
    """Attempts per S3 request (botocore ``standard`` mode: exponential backoff, jitter) and per
    whole-file transfer that breaks mid-stream."""

    retry_backoff_s: float = Field(default=1.0, gt=0)
    """First wait before retrying a broken transfer; doubles each attempt (at most 30 s)."""

    connect_timeout_s: float = Field(default=10.0, gt=0)
    """Seconds to wait for a connection to the S3 endpoint."""

    read_timeout_s: float = Field(default=60.0, gt=0)
    """Seconds to wait for data on an open S3 connection."""

    @field_validator("uri")
    @classmethod
    def _check_uri(cls, value: str) -> str:
        return check_storage_uri(value)

    def should_save(self, step: int) -> bool:
        """Whether the cadence asks for a checkpoint after optimizer step ``step``."""
        return self.every_steps is not None and step > 0 and step % self.every_steps == 0


def check_storage_uri(value: str) -> str:
    """A local directory or ``s3://bucket/prefix``; anything else raises ``ValueError`` (for pydantic)."""
    if value.startswith("s3://") and not value.removeprefix("s3://").split("/")[0]:
        raise ValueError("an s3:// uri needs a bucket: s3://bucket/prefix")
    if "://" in value and not value.startswith("s3://"):
        raise ValueError("uri must be a local directory or s3://bucket/prefix")
    return value


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint: its step and URI."""

    step: int
    uri: str


def open_storage(uri: str, config: CheckpointConfig) -> CheckpointStorage:
    """The backend for ``uri``: S3 for ``s3://``, else a local directory."""
    if uri.startswith("s3://"):
        from mt_ray.tracking.ckpt_s3 import S3Storage  # boto3 is an optional dependency

        return S3Storage(uri, config)
    return LocalStorage(uri)


class CheckpointManager:
    """Saves, lists, prunes and loads checkpoints under ``config.uri``.

    ``storage`` is the seam for another backend (or a test fake); by default it follows the URI.
    One process writes to a URI at a time (on multi-worker runs, rank 0).
    """

    def __init__(self, config: CheckpointConfig, storage: CheckpointStorage | None = None):
        self.config = config
        self.storage = storage if storage is not None else open_storage(config.uri, config)

    def save(self, step: int, tensors: dict[str, torch.Tensor], meta: dict) -> str:
        """Write a checkpoint of ``tensors`` and ``meta`` at ``step``; returns its URI once complete.

        Call between steps: the tensors are read while this runs (no copy is taken). A crash at
        any point leaves earlier checkpoints intact and loadable; older ones beyond ``keep_last``
        are deleted only after this one is complete.
        """
        check_meta(meta)
        shards, records = plan_shards(tensors, self.config.shard_bytes)
        self.storage.cleanup_incomplete()
        name = step_dir_name(step)
        writer = self.storage.begin(name)
        try:
            files = self._write_shards(writer, shards)
            writer.commit(Manifest(step=step, meta=meta, tensors=records, files=files).to_json())
        except OSError as e:
            writer.abort()
            raise CheckpointError(f"writing checkpoint {self.storage.uri(name)} failed: {e}") from e
        except BaseException:
            writer.abort()
            raise
        self._prune(step)
        return self.storage.uri(name)

    def latest(self) -> str | None:
        """URI of the newest complete checkpoint (manifest present; shards are verified on load)."""
        names = self.storage.list_complete()
        return self.storage.uri(names[-1]) if names else None

    def read_meta(self, uri: str) -> dict:
        """The ``meta`` saved with checkpoint ``uri``, from its manifest alone (no tensor is read)."""
        storage, name = self._locate(uri)
        return Manifest.from_json(storage.read_manifest(name), storage.uri(name)).meta

    def uri_of(self, step: int) -> str:
        """The URI checkpoint ``step`` has (or would have) under this manager's root."""
        return self.storage.uri(step_dir_name(step))

    def list(self) -> list[CheckpointInfo]:
        """Complete checkpoints, oldest step first."""
        return [CheckpointInfo(parse_step(n), self.storage.uri(n)) for n in self.storage.list_complete()]

    def load(self, uri: str | None = None,
             out: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
        """Read and verify a checkpoint; returns ``(tensors, meta)``.

        ``uri=None`` loads the newest checkpoint that verifies, falling back past corrupted ones
        with a warning. ``out`` maps names to preallocated contiguous CPU tensors (e.g. the
        engine's live buffers) that are filled in place and returned, so a resume does not hold
        the state twice; other tensors are allocated. Every shard's SHA-256 is checked while it is
        read; a mismatch raises ``CheckpointError`` naming the file. After a failed load the
        ``out`` tensors hold partial data.
        """
        if uri is not None:
            storage, name = self._locate(uri)
            return self._load_from(storage, name, out or {})
        names = self.storage.list_complete()
        if not names:
            raise CheckpointError(f"no complete checkpoint under {self.storage.root_uri}")
        problems = []
        for name in reversed(names):
            try:
                return self._load_from(self.storage, name, out or {})
            except CheckpointCorruptedError as e:
                logger.warning("%s; falling back to the previous checkpoint", e)
                problems.append(str(e))
        raise CheckpointError(f"no valid checkpoint under {self.storage.root_uri}: " + "; ".join(problems))

    def _write_shards(self, writer: CheckpointWriter, shards: list[ShardSource]) -> dict[str, FileRecord]:
        with ThreadPoolExecutor(self.config.io_workers, thread_name_prefix="ckpt-write") as pool:
            records = list(pool.map(writer.write_file, shards))
        return {shard.file: record for shard, record in zip(shards, records, strict=True)}

    def _load_from(self, storage: CheckpointStorage, name: str,
                   out: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
        where = storage.uri(name)
        manifest = Manifest.from_json(storage.read_manifest(name), where)
        unknown = set(out) - set(manifest.tensors)
        if unknown:
            raise CheckpointError(f"{where} has no tensors {sorted(unknown)} to load into the out buffers")
        tensors = {}
        for tname, record in manifest.tensors.items():
            if tname in out:
                check_out_buffer(tname, record, out[tname])
            tensors[tname] = out[tname] if tname in out else empty_tensor(record)

        def read_piece(job: tuple) -> None:
            tname, piece = job
            if piece.file not in manifest.files:
                raise CheckpointCorruptedError(f"{where}/{MANIFEST_NAME} lists no hash for {piece.file}")
            dest = tensors[tname].view(-1)[piece.start:piece.start + piece.numel]
            storage.read_file(name, piece.file, lambda stream: read_shard_into(
                stream, dest, piece, tname, manifest.files[piece.file], f"{where}/{piece.file}"))

        jobs = [(tname, p) for tname, record in manifest.tensors.items() for p in record.pieces]
        with ThreadPoolExecutor(self.config.io_workers, thread_name_prefix="ckpt-read") as pool:
            list(pool.map(read_piece, jobs))
        return tensors, manifest.meta

    def _locate(self, uri: str) -> tuple[CheckpointStorage, str]:
        """The storage holding checkpoint ``uri`` (this manager's own when it is under the root)."""
        if uri.startswith("s3://"):
            parent, _, name = uri.rstrip("/").rpartition("/")
        else:
            path = Path(uri).expanduser().resolve()
            parent, name = str(path.parent), path.name
        if parse_step(name) is None:
            raise CheckpointError(f"{uri} is not a checkpoint folder (step-XXXXXXXX)")
        if parent == self.storage.root_uri:
            return self.storage, name
        return open_storage(parent, self.config), name

    def _prune(self, step: int) -> None:
        names = self.storage.list_complete()
        newer = [n for n in names if parse_step(n) > step]
        if newer:  # saved after resuming from an older checkpoint: the newer ones are left alone
            logger.warning("checkpoints newer than step %d exist under %s (%s); latest() still returns %s",
                           step, self.storage.root_uri, ", ".join(newer), newer[-1])
        if self.config.keep_last is not None:
            up_to_now = [n for n in names if parse_step(n) <= step]
            for old in up_to_now[:-self.config.keep_last]:
                self.storage.delete(old)
