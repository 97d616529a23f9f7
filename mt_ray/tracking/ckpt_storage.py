"""Where checkpoints live: the storage seam of ``CheckpointManager`` and its local-disk backend.

A backend stores checkpoint folders (``step-00000123``) under one root. Writing goes through a
``CheckpointWriter`` that publishes a folder only in ``commit``, after every shard and then the
manifest are durable; anything a crash leaves behind is invisible to ``list_complete`` and is
removed by ``cleanup_incomplete``. One process writes to a root at a time.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Protocol

from mt_ray.errors import CheckpointError
from mt_ray.tracking.ckpt_format import (
    MANIFEST_NAME,
    CheckpointCorruptedError,
    FileRecord,
    HashingBlocks,
    ShardSource,
    parse_step,
)


class CheckpointWriter(Protocol):
    """Writes one checkpoint folder; nothing is visible until ``commit`` returns."""

    def write_file(self, source: ShardSource) -> FileRecord:
        """Store one shard, hashing it as it streams; safe to call from several threads at once."""
        ...

    def commit(self, manifest: bytes) -> None:
        """Store the manifest last and publish the folder, replacing one of the same name."""
        ...

    def abort(self) -> None:
        """Remove what this writer stored (best effort: a crash skips this, ``cleanup_incomplete`` finishes it)."""
        ...


class CheckpointStorage(Protocol):
    """A root holding checkpoint folders."""

    root_uri: str

    def uri(self, dir_name: str) -> str:
        """The URI of a folder under the root (what ``CheckpointManager.save`` returns)."""
        ...

    def list_complete(self) -> list[str]:
        """Folder names that have a manifest, oldest step first."""
        ...

    def cleanup_incomplete(self) -> None:
        """Remove what interrupted writes and deletes left behind."""
        ...

    def begin(self, dir_name: str) -> CheckpointWriter:
        ...

    def read_manifest(self, dir_name: str) -> bytes:
        ...

    def read_file(self, dir_name: str, file: str, reader: Callable[[BinaryIO], None]) -> None:
        """Open one stored file as a stream and hand it to ``reader`` (again, if a backend retries)."""
        ...

    def delete(self, dir_name: str) -> None:
        """Delete a folder; it stops counting as complete before anything else is removed."""
        ...


class LocalStorage:
    """Checkpoint folders in a local (or network-mounted) directory, published by atomic rename."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().resolve()
        self.root_uri = str(self.root)

    def uri(self, dir_name: str) -> str:
        return str(self.root / dir_name)

    def list_complete(self) -> list[str]:
        if not self.root.is_dir():
            return []
        names = [p.name for p in self.root.iterdir()
                 if parse_step(p.name) is not None and (p / MANIFEST_NAME).is_file()]
        return sorted(names, key=parse_step)

    def cleanup_incomplete(self) -> None:
        if self.root.is_dir():
            for p in self.root.iterdir():
                if p.is_dir() and (".tmp-" in p.name or ".trash-" in p.name):
                    shutil.rmtree(p, ignore_errors=True)

    def begin(self, dir_name: str) -> LocalWriter:
        tmp = self.root / f"{dir_name}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            tmp.mkdir(parents=True)
        except OSError as e:
            raise CheckpointError(f"cannot create checkpoint folder {tmp}: {e}") from None
        return LocalWriter(self.root / dir_name, tmp)

    def read_manifest(self, dir_name: str) -> bytes:
        path = self.root / dir_name / MANIFEST_NAME
        if not path.is_file():
            raise CheckpointError(f"no checkpoint at {self.root / dir_name} ({MANIFEST_NAME} missing)")
        return path.read_bytes()

    def read_file(self, dir_name: str, file: str, reader: Callable[[BinaryIO], None]) -> None:
        path = self.root / dir_name / file
        try:
            with open(path, "rb", buffering=0) as stream:  # unbuffered: readinto lands in the tensor directly
                reader(stream)
        except FileNotFoundError:
            raise CheckpointCorruptedError(f"{path} is missing") from None

    def delete(self, dir_name: str) -> None:
        trash = self.root / f"{dir_name}.trash-{uuid.uuid4().hex[:12]}"
        os.replace(self.root / dir_name, trash)  # atomic: the folder is gone as a checkpoint at once
        shutil.rmtree(trash, ignore_errors=True)


class LocalWriter:
    """Writes into ``<name>.tmp-<id>/``, fsyncs, then renames it to ``<name>/``."""

    def __init__(self, final: Path, tmp: Path):
        self.final = final
        self.tmp = tmp

    def write_file(self, source: ShardSource) -> FileRecord:
        hashed = HashingBlocks(source.blocks())
        with open(self.tmp / source.file, "wb") as f:
            for block in hashed:
                f.write(block)  # blocks larger than the buffer go straight to the file, uncopied
            f.flush()
            os.fsync(f.fileno())
        return hashed.record()

    def commit(self, manifest: bytes) -> None:
        with open(self.tmp / MANIFEST_NAME, "wb") as f:
            f.write(manifest)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(self.tmp)
        trash = None
        if self.final.exists():  # re-saving a step: move the old one aside, it cannot be renamed over
            trash = self.final.with_name(f"{self.final.name}.trash-{uuid.uuid4().hex[:12]}")
            os.replace(self.final, trash)
        os.replace(self.tmp, self.final)
        _fsync_dir(self.final.parent)  # the rename itself is durable only once the parent is synced
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
