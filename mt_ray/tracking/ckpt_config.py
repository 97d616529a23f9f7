"""Where and how checkpoints are written (`checkpoint.*` of a run config); read by the manager and both backends."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


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
