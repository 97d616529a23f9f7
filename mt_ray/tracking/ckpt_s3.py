"""S3 backend for checkpoints (boto3; any S3-compatible endpoint).

A checkpoint is the key prefix ``<prefix>/step-00000123/``. S3 has no rename, so completeness
is the manifest: it is uploaded last, deleted first, and a prefix without one is never loaded.
Large shards go up as multipart uploads (boto3 ``TransferConfig``), read part by part from the
tensor's memory and hashed on the way. Requests retry with exponential backoff and jitter
(botocore's ``standard`` mode); a whole-file transfer broken mid-stream is retried here.
Credentials come from boto3's usual chain (environment, profile, instance role) and never appear
in logs or errors.

A crash mid-upload can leave an unfinished multipart upload on the bucket, invisible and billed;
a lifecycle rule ``AbortIncompleteMultipartUpload`` (e.g. after 1 day) removes those.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config as BotoConfig
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionError,
    ConnectTimeoutError,
    EndpointConnectionError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    ProfileNotFound,
)

from mt_ray.errors import CheckpointError
from mt_ray.tracking.ckpt_format import (
    MANIFEST_NAME,
    CheckpointCorruptedError,
    FileRecord,
    HashingBlocks,
    ShardSource,
    parse_step,
)

if TYPE_CHECKING:
    from mt_ray.tracking.ckpt_config import CheckpointConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")

_TRANSIENT = (ConnectionError, HTTPClientError, IncompleteReadError)
_BAD_CREDENTIALS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
                    "TokenRefreshRequired", "InvalidClientTokenId"}
_ACCESS_DENIED = {"AccessDenied", "403", "AllAccessDisabled"}
_CREDENTIALS_FIX = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (plus AWS_SESSION_TOKEN for temporary "
                    "credentials), or AWS_PROFILE / checkpoint.aws_profile naming a profile in ~/.aws/credentials")
_MAX_BACKOFF_S = 30.0
_DELETE_BATCH = 1000  # DeleteObjects takes at most this many keys


def split_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b/`` -> ``("bucket", "a/b")``."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return bucket, prefix.strip("/")


class S3Storage:
    """Checkpoint folders as key prefixes under ``s3://bucket/prefix``.

    ``client`` is the seam for a pre-built boto3 S3 client; by default one is built from the
    config. Construction lists the prefix once, so a missing bucket, bad credentials or an
    unreachable endpoint fail here, before training starts, with a ``CheckpointError`` saying
    what to fix.
    """

    def __init__(self, uri: str, config: CheckpointConfig, client: Any = None):
        self.bucket, self.prefix = split_s3_uri(uri)
        self.root_uri = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        self.config = config
        self.client = client if client is not None else self._call(lambda: build_s3_client(config), "connect")
        self.transfer = TransferConfig(
            multipart_threshold=config.multipart_threshold_bytes, multipart_chunksize=config.multipart_chunk_bytes,
            max_concurrency=config.max_concurrency, preferred_transfer_client="classic")
        self._call(lambda: self.client.list_objects_v2(Bucket=self.bucket, Prefix=self._key(""), MaxKeys=1),
                   f"listing {self.root_uri}")

    def __reduce__(self):
        # A boto3 client does not pickle: another process (a data-parallel shard writing its part)
        # rebuilds one from the same config.
        return S3Storage, (self.root_uri, self.config)

    def uri(self, dir_name: str) -> str:
        return f"{self.root_uri}/{dir_name}"

    def list_complete(self) -> list[str]:
        folders = self._folders()
        names = [d for d, files in folders.items() if parse_step(d) is not None and MANIFEST_NAME in files]
        return sorted(names, key=parse_step)

    def cleanup_incomplete(self) -> None:
        for d, files in self._folders().items():
            if parse_step(d) is not None and MANIFEST_NAME not in files:
                self._delete_keys([self._key(f"{d}/{f}") for f in files])

    def begin(self, dir_name: str) -> S3Writer:
        self.delete(dir_name)  # a re-saved step must not mix old and new shards
        return S3Writer(self, dir_name)

    def read_manifest(self, dir_name: str) -> bytes:
        key = self._key(f"{dir_name}/{MANIFEST_NAME}")
        try:
            return self.retrying(lambda: self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read(),
                                 f"reading {self.uri(dir_name)}")
        except _Missing:
            raise CheckpointError(f"no checkpoint at {self.uri(dir_name)} ({MANIFEST_NAME} missing)") from None

    def read_file(self, dir_name: str, file: str, reader: Callable[[BinaryIO], None]) -> None:
        key = self._key(f"{dir_name}/{file}")

        def attempt() -> None:
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
            with closing(body):
                reader(body)

        try:
            self.retrying(attempt, f"download of s3://{self.bucket}/{key}")
        except _Missing:
            raise CheckpointCorruptedError(f"s3://{self.bucket}/{key} is missing") from None

    def delete(self, dir_name: str) -> None:
        files = self._folders(dir_name).get(dir_name, [])
        if MANIFEST_NAME in files:  # manifest first: a half-deleted checkpoint is never taken as complete
            self._delete_keys([self._key(f"{dir_name}/{MANIFEST_NAME}")])
        self._delete_keys([self._key(f"{dir_name}/{f}") for f in files if f != MANIFEST_NAME])

    def retrying(self, fn: Callable[[], T], what: str) -> T:
        """Run ``fn``, retrying transient network failures with exponential backoff and jitter."""
        for attempt in range(1, self.config.retries + 1):
            try:
                return fn()
            except _TRANSIENT as e:
                if attempt == self.config.retries:
                    raise self._error(e, what) from None
                delay = min(_MAX_BACKOFF_S, self.config.retry_backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1)
                logger.warning("%s failed (%s); retry %d of %d in %.1f s", what, type(e).__name__, attempt,
                               self.config.retries - 1, delay)
                time.sleep(delay)
            except (BotoCoreError, ClientError) as e:
                raise self._error(e, what) from None
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _call(self, fn: Callable[[], T], what: str) -> T:
        """Run one request (botocore already retries it); translate failures into ``CheckpointError``."""
        try:
            return fn()
        except (BotoCoreError, ClientError) as e:
            raise self._error(e, what) from None

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _folders(self, only: str = "") -> dict[str, list[str]]:
        """Files under each folder of the root (one level of folders), by listing every key."""
        folders: dict[str, list[str]] = {}
        prefix = self._key(f"{only}/" if only else "")
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        for page in self._call(lambda: list(pages), f"listing {self.root_uri}"):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(self._key("")):]
                folder, _, file = rel.partition("/")
                if file:
                    folders.setdefault(folder, []).append(file)
        return folders

    def _delete_keys(self, keys: list[str]) -> None:
        for i in range(0, len(keys), _DELETE_BATCH):
            batch = [{"Key": k} for k in keys[i:i + _DELETE_BATCH]]
            self._call(lambda b=batch: self.client.delete_objects(Bucket=self.bucket,
                                                                  Delete={"Objects": b, "Quiet": True}),
                       f"deleting under {self.root_uri}")

    def _error(self, e: Exception, what: str) -> CheckpointError:
        return s3_error(e, what, self.bucket, self.config.endpoint_url or "the AWS default endpoint")


class _Missing(CheckpointError):
    """An object that should exist does not (raised inside this module, translated by callers)."""


class S3Writer:
    """Uploads the shards of one checkpoint, then its manifest."""

    def __init__(self, storage: S3Storage, dir_name: str):
        self.storage = storage
        self.dir_name = dir_name

    def write_file(self, source: ShardSource) -> FileRecord:
        s = self.storage
        key = s._key(f"{self.dir_name}/{source.file}")

        def attempt() -> FileRecord:
            hashed = HashingBlocks(source.blocks())  # a fresh pass per attempt: the hash is of what was sent
            s.client.upload_fileobj(BlockReader(hashed), s.bucket, key, Config=s.transfer)
            return hashed.record()

        return s.retrying(attempt, f"upload of s3://{s.bucket}/{key}")

    def commit(self, manifest: bytes) -> None:
        s = self.storage
        key = s._key(f"{self.dir_name}/{MANIFEST_NAME}")
        s.retrying(lambda: s.client.put_object(Bucket=s.bucket, Key=key, Body=manifest), f"upload of {key}")

    def abort(self) -> None:
        try:
            self.storage.delete(self.dir_name)
        except CheckpointError as e:  # the next save's cleanup_incomplete retries this
            logger.warning("could not remove the unfinished checkpoint %s: %s", self.storage.uri(self.dir_name), e)


class BlockReader:
    """A non-seekable file object over blocks of bytes, which s3transfer reads part by part, in order."""

    def __init__(self, blocks: Iterable[memoryview]):
        self._blocks: Iterator[memoryview] = iter(blocks)
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        out = bytearray()
        while n < 0 or len(out) < n:
            if not self._pending:
                block = next(self._blocks, None)
                if block is None:
                    break
                self._pending = block
            take = len(self._pending) if n < 0 else min(n - len(out), len(self._pending))
            out += self._pending[:take]
            self._pending = self._pending[take:]
        return bytes(out)


def build_s3_client(config: CheckpointConfig) -> Any:
    session = boto3.session.Session(profile_name=config.aws_profile, region_name=config.region)
    return session.client("s3", endpoint_url=config.endpoint_url, config=BotoConfig(
        retries={"max_attempts": config.retries, "mode": "standard"},
        connect_timeout=config.connect_timeout_s, read_timeout=config.read_timeout_s,
        max_pool_connections=config.io_workers * config.max_concurrency))


def s3_error(e: Exception, what: str, bucket: str, endpoint: str) -> CheckpointError:
    """A ``CheckpointError`` that says what to fix; it never includes credentials."""
    if isinstance(e, NoCredentialsError | PartialCredentialsError):
        return CheckpointError(f"{what}: no usable AWS credentials found; {_CREDENTIALS_FIX}")
    if isinstance(e, ProfileNotFound):
        return CheckpointError(f"{what}: {e}; fix checkpoint.aws_profile or the AWS_PROFILE variable")
    if isinstance(e, EndpointConnectionError | ConnectTimeoutError):
        return CheckpointError(f"{what}: cannot reach the S3 endpoint {endpoint}; check checkpoint.endpoint_url, "
                               "that the server is up, and the network")
    if isinstance(e, ClientError):
        code = str(e.response.get("Error", {}).get("Code", ""))
        if code in _BAD_CREDENTIALS:
            return CheckpointError(f"{what}: S3 rejected the credentials ({code}); {_CREDENTIALS_FIX}")
        if code == "NoSuchBucket":
            return CheckpointError(f"{what}: bucket {bucket!r} does not exist at {endpoint}; create it or fix "
                                   "training.storage")
        if code == "NoSuchKey":
            return _Missing(f"{what}: not found")
        if code in _ACCESS_DENIED:
            return CheckpointError(f"{what}: access denied to bucket {bucket!r}; the credentials need s3:ListBucket, "
                                   "s3:GetObject, s3:PutObject and s3:DeleteObject on it")
    return CheckpointError(f"{what} failed: {type(e).__name__}: {e}")
