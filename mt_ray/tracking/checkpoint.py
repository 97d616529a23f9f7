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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from mt_ray.errors import CheckpointError
from mt_ray.tracking.ckpt_config import CheckpointConfig
from mt_ray.tracking.ckpt_format import (
    MANIFEST_NAME,
    CheckpointCorruptedError,
    FileRecord,
    Manifest,
    Piece,
    RangeReader,
    RangeShard,
    ShardSource,
    TensorRecord,
    check_meta,
    check_out_buffer,
    empty_tensor,
    parse_step,
    plan_range_shards,
    plan_shards,
    read_shard_into,
    step_dir_name,
)
from mt_ray.tracking.ckpt_storage import CheckpointStorage, CheckpointWriter, LocalStorage

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class StoredCheckpoint:
    """One complete checkpoint folder and its manifest: what a reader needs, picklable."""

    storage: CheckpointStorage
    name: str
    manifest: Manifest

    @classmethod
    def open(cls, storage: CheckpointStorage, name: str) -> StoredCheckpoint:
        where = storage.uri(name)
        return cls(storage, name, Manifest.from_json(storage.read_manifest(name), where))

    @property
    def where(self) -> str:
        return self.storage.uri(self.name)

    def read_range(self, tensor: str, lo: int, hi: int, dest: torch.Tensor) -> None:
        """Elements ``[lo, hi)`` of the flattened ``tensor`` into the 1-D ``dest``, every piece verified.

        Pieces inside the range are read straight into ``dest``; one that crosses its edge (the
        checkpoint was cut for another number of writers) is read whole and its overlap copied.
        """
        record = self.manifest.tensors[tensor]
        for piece in record.pieces:
            a, b = max(lo, piece.start), min(hi, piece.start + piece.numel)
            if a >= b and piece.numel:
                continue
            inside = a == piece.start and b == piece.start + piece.numel
            buf = dest[a - lo:b - lo] if inside else torch.empty(piece.numel, dtype=dest.dtype)
            self._read_piece(tensor, piece, buf)
            if not inside:
                dest[a - lo:b - lo] = buf[a - piece.start:b - piece.start]

    def _read_piece(self, tensor: str, piece: Piece, dest: torch.Tensor) -> None:
        files = self.manifest.files
        if piece.file not in files:
            raise CheckpointCorruptedError(f"{self.where}/{MANIFEST_NAME} lists no hash for {piece.file}")
        self.storage.read_file(self.name, piece.file, lambda stream: read_shard_into(
            stream, dest, piece, tensor, files[piece.file], f"{self.where}/{piece.file}"))


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
        shards, records = plan_shards(tensors, self.config.shard_bytes)
        return self.save_with(step, records, meta, lambda writer: self._write_shards(writer, shards))

    def save_ranges(self, step: int, sources: dict[str, RangeReader], meta: dict) -> str:
        """``save`` of tensors kept elsewhere (an engine's optimizer state on NVMe), each read by range a block at
        a time as its shards are written: the checkpoint never holds a tensor in memory."""
        shards, records = plan_range_shards(sources, self.config.shard_bytes)
        return self.save_with(step, records, meta, lambda writer: self._write_shards(writer, shards))

    def save_with(self, step: int, records: dict[str, TensorRecord], meta: dict,
                  write: Callable[[CheckpointWriter], dict[str, FileRecord]]) -> str:
        """``save`` where ``write`` stores the pieces ``records`` lists (e.g. each from the process
        holding them, given the picklable writer) and returns their file records; the manifest is
        written here, last, so the checkpoint is complete only once every writer has finished."""
        check_meta(meta)
        self.storage.cleanup_incomplete()
        name = step_dir_name(step)
        writer = self.storage.begin(name)
        try:
            files = write(writer)
            missing = {p.file for r in records.values() for p in r.pieces} - set(files)
            if missing:
                raise CheckpointError(f"checkpoint {self.storage.uri(name)}: no writer stored {sorted(missing)[:3]}")
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
        return self.load_with(lambda stored: self._load_from(stored, out or {}), uri)

    def load_with(self, read: Callable[[StoredCheckpoint], T], uri: str | None = None) -> T:
        """``read`` one stored checkpoint (``uri``, or the newest that verifies) and return what it returns.

        ``read`` gets the checkpoint's storage, folder and manifest (picklable, so the processes
        holding a data-parallel run's state can each read their own range with ``read_range``);
        a ``CheckpointCorruptedError`` it raises makes ``uri=None`` fall back to the previous one.
        """
        if uri is not None:
            storage, name = self._locate(uri)
            return read(StoredCheckpoint.open(storage, name))
        names = self.storage.list_complete()
        if not names:
            raise CheckpointError(f"no complete checkpoint under {self.storage.root_uri}")
        problems = []
        for name in reversed(names):
            try:
                return read(StoredCheckpoint.open(self.storage, name))
            except CheckpointCorruptedError as e:
                logger.warning("%s; falling back to the previous checkpoint", e)
                problems.append(str(e))
        raise CheckpointError(f"no valid checkpoint under {self.storage.root_uri}: " + "; ".join(problems))

    def _write_shards(self, writer: CheckpointWriter, shards: list[ShardSource | RangeShard]) -> dict[str, FileRecord]:
        with ThreadPoolExecutor(self.config.io_workers, thread_name_prefix="ckpt-write") as pool:
            records = list(pool.map(writer.write_file, shards))
        return {shard.file: record for shard, record in zip(shards, records, strict=True)}

    def _load_from(self, stored: StoredCheckpoint,
                   out: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
        manifest = stored.manifest
        unknown = set(out) - set(manifest.tensors)
        if unknown:
            raise CheckpointError(f"{stored.where} has no tensors {sorted(unknown)} to load into the out buffers")
        tensors = {}
        for tname, record in manifest.tensors.items():
            if tname in out:
                check_out_buffer(tname, record, out[tname])
            tensors[tname] = out[tname] if tname in out else empty_tensor(record)
        jobs = [(tname, p.start, p.start + p.numel, tensors[tname].view(-1)[p.start:p.start + p.numel])
                for tname, record in manifest.tensors.items() for p in record.pieces]  # one job per piece
        with ThreadPoolExecutor(self.config.io_workers, thread_name_prefix="ckpt-read") as pool:
            list(pool.map(lambda job: stored.read_range(*job), jobs))
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
