"""On-disk format of one checkpoint: safetensors shards plus a ``manifest.json`` written last.

A checkpoint is a folder ``step-00000123/``. Every tensor is flattened and cut into pieces of at
most ``shard_bytes``; piece ``i`` of ``n`` of tensor ``master`` is the file
``master.0000i-of-0000n.safetensors`` holding one 1-D tensor named ``master``, and the manifest
records where each piece starts in the flat tensor, so the pieces reassemble exactly. The
manifest also holds every file's size and SHA-256, the caller's JSON ``meta`` and the format
version. A folder without a manifest is an unfinished write and is never loaded.

Shards are written and read here by hand (an 8-byte header length, a JSON header, raw bytes: the
safetensors layout) rather than through ``safetensors.torch.save_file`` so that bytes stream
straight from the tensor's memory to the file, hashed on the way, and straight back into a
preallocated tensor on load: no second read pass and no copy of a multi-GB buffer. The files
are ordinary safetensors files; ``safetensors.safe_open`` reads them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO, Protocol

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from mt_ray.errors import CheckpointError

FORMAT_NAME = "mt-ray-checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
BLOCK_BYTES = 16 << 20  # bytes per write/read/hash call: large enough to amortize syscalls, small in RAM

_MAX_HEADER_BYTES = 1 << 20  # our headers hold one entry; a bigger length means a corrupted file
_STEP_RE = re.compile(r"^step-(\d{8,})$")
_TENSOR_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH_DTYPES = {str(dt).removeprefix("torch."): dt for dt in _ST_DTYPES}


class CheckpointCorruptedError(CheckpointError):
    """A stored checkpoint's bytes are wrong or missing; an older checkpoint may still be good."""


class FileRecord(BaseModel):
    """Size and SHA-256 of one stored file."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    size: int
    sha256: str


class Piece(BaseModel):
    """Elements ``[start, start + numel)`` of a flattened tensor, stored in ``file``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    file: str
    start: int
    numel: int


class TensorRecord(BaseModel):
    """A saved tensor: dtype name (``float32``), shape, and its pieces in order."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    dtype: str
    shape: list[int]
    pieces: list[Piece]


class Manifest(BaseModel):
    """Everything needed to verify and reassemble one checkpoint."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    step: int
    meta: dict
    tensors: dict[str, TensorRecord]
    files: dict[str, FileRecord]

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> Manifest:
        try:
            manifest = cls.model_validate_json(raw)
        except ValidationError as e:
            raise CheckpointCorruptedError(f"{where}/{MANIFEST_NAME} is not a valid manifest: {e}") from None
        if manifest.format != FORMAT_NAME or manifest.format_version > FORMAT_VERSION:
            raise CheckpointError(
                f"{where} has format {manifest.format!r} v{manifest.format_version}; this mt-ray reads "
                f"{FORMAT_NAME!r} up to v{FORMAT_VERSION} (upgrade mt-ray to load it)")
        return manifest


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def parse_step(dir_name: str) -> int | None:
    """The step of a finished checkpoint folder name, or ``None`` for anything else (temp folders)."""
    m = _STEP_RE.match(dir_name)
    return int(m.group(1)) if m else None


def check_meta(meta: dict) -> None:
    """Refuse meta that JSON would change (tuples, int keys, NaN...), so a resume sees what was saved."""
    try:
        same = json.loads(json.dumps(meta, allow_nan=False)) == meta
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint meta is not JSON-serializable: {e}") from None
    if not same:
        raise CheckpointError("checkpoint meta changes through JSON (tuples or non-string keys?): "
                              "use lists and string keys so a resume gets exactly what was saved")


@dataclass(frozen=True)
class ShardSource:
    """One shard to write: its file name and the bytes of its piece (a view, never a copy)."""

    file: str
    name: str
    start: int
    flat: torch.Tensor  # 1-D contiguous view of the piece's elements

    def header(self) -> bytes:
        return _shard_header(self.name, self.start, self.flat.dtype, self.flat.numel())

    def blocks(self) -> Iterator[memoryview]:
        """The file's bytes in order: header, then the piece's memory in ``BLOCK_BYTES`` slices."""
        yield memoryview(self.header())
        data = _bytes_view(self.flat)
        for pos in range(0, len(data), BLOCK_BYTES):
            yield data[pos:pos + BLOCK_BYTES]


class RangeReader(Protocol):
    """A flat tensor kept elsewhere (e.g. in files), read by range into a caller's buffer."""

    dtype: torch.dtype
    numel: int

    def read(self, lo: int, dest: torch.Tensor) -> None:
        """Elements [lo, lo + dest.numel()) into the 1-D `dest`."""


@dataclass(frozen=True)
class RangeShard:
    """One shard whose piece is read from a `RangeReader` BLOCK_BYTES at a time into one reused buffer, so
    writing it holds a block of the tensor in memory, never the piece (same file as a `ShardSource`'s)."""

    file: str
    name: str
    start: int
    numel: int
    source: RangeReader

    def header(self) -> bytes:
        return _shard_header(self.name, self.start, self.source.dtype, self.numel)

    def blocks(self) -> Iterator[memoryview]:
        """The header, then the piece block by block (each block is consumed before the next is read into it)."""
        yield memoryview(self.header())
        per_block = max(1, BLOCK_BYTES // self.source.dtype.itemsize)
        buf = torch.empty(min(per_block, self.numel), dtype=self.source.dtype)
        for pos in range(0, self.numel, per_block):
            part = buf[: min(per_block, self.numel - pos)]
            self.source.read(self.start + pos, part)
            yield _bytes_view(part)


def plan_range_shards(sources: dict[str, RangeReader],
                      shard_bytes: int) -> tuple[list[RangeShard], dict[str, TensorRecord]]:
    """`plan_shards` for tensors read by range."""
    records = {name: plan_pieces(name, src.dtype, [src.numel], shard_bytes) for name, src in sources.items()}
    shards = [RangeShard(p.file, name, p.start, p.numel, sources[name]) for name, r in records.items() for p in r.pieces]
    return shards, records


def _shard_header(name: str, start: int, dtype: torch.dtype, numel: int) -> bytes:
    entries = {
        "__metadata__": {"format": "pt", "tensor": name, "start": str(start)},
        name: {"dtype": _ST_DTYPES[dtype], "shape": [numel], "data_offsets": [0, numel * dtype.itemsize]},
    }
    body = json.dumps(entries, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)  # safetensors pads so the data starts 8-byte aligned
    return struct.pack("<Q", len(body)) + body


def plan_shards(tensors: dict[str, torch.Tensor],
                shard_bytes: int) -> tuple[list[ShardSource], dict[str, TensorRecord]]:
    """Cut every tensor into pieces of at most ``shard_bytes``; returns the shards and tensor records."""
    shards: list[ShardSource] = []
    records: dict[str, TensorRecord] = {}
    for name, tensor in tensors.items():
        flat = tensor.detach().cpu().contiguous().view(-1)  # no copy for the engine's flat CPU buffers
        records[name] = plan_pieces(name, tensor.dtype, list(tensor.shape), shard_bytes)
        shards += [ShardSource(p.file, name, p.start, flat[p.start:p.start + p.numel]) for p in records[name].pieces]
    return shards, records


def plan_pieces(name: str, dtype: torch.dtype, shape: list[int], shard_bytes: int,
                cuts: list[int] = ()) -> TensorRecord:
    """The pieces of one flattened tensor: at most ``shard_bytes`` each, and none straddling a cut.

    ``cuts`` are element offsets where one writer's part ends and the next one's begins (the
    coordinator shards of a data-parallel run each write their own range), so every piece is
    written by exactly one process.
    """
    if not _TENSOR_NAME_RE.match(name):
        raise CheckpointError(f"checkpoint tensor name {name!r} must match {_TENSOR_NAME_RE.pattern} "
                              "(it becomes a file name)")
    if dtype not in _ST_DTYPES:
        raise CheckpointError(f"checkpoint tensor {name!r} has unsupported dtype {dtype}")
    numel = math.prod(shape)
    per_piece = max(1, shard_bytes // dtype.itemsize)
    bounds = sorted({0, numel, *(c for c in cuts if 0 < c < numel)})
    spans = [(s, min(s + per_piece, hi)) for lo, hi in itertools.pairwise(bounds) for s in range(lo, hi, per_piece)]
    spans = spans or [(0, 0)]
    pieces = [Piece(file=f"{name}.{i:05d}-of-{len(spans):05d}.safetensors", start=lo, numel=hi - lo)
              for i, (lo, hi) in enumerate(spans)]
    return TensorRecord(dtype=_dtype_name(dtype), shape=shape, pieces=pieces)


class HashingBlocks:
    """Passes blocks through while counting bytes and updating a SHA-256: hashing costs no extra read."""

    def __init__(self, blocks: Iterator[memoryview]):
        self._blocks = blocks
        self._sha = hashlib.sha256()
        self.size = 0

    def __iter__(self) -> Iterator[memoryview]:
        for block in self._blocks:
            self._sha.update(block)
            self.size += len(block)
            yield block

    def record(self) -> FileRecord:
        return FileRecord(size=self.size, sha256=self._sha.hexdigest())


def empty_tensor(record: TensorRecord) -> torch.Tensor:
    """A fresh, uninitialized tensor to load ``record`` into."""
    return torch.empty(record.shape, dtype=_torch_dtype(record.dtype))


def check_out_buffer(name: str, record: TensorRecord, out: torch.Tensor) -> None:
    """A caller's buffer must match the saved tensor exactly: loading into it must not reshape or cast."""
    if (_dtype_name(out.dtype) != record.dtype or list(out.shape) != record.shape
            or out.device.type != "cpu" or not out.is_contiguous()):
        raise CheckpointError(
            f"out buffer for {name!r} is {out.dtype} {list(out.shape)} on {out.device} "
            f"(contiguous={out.is_contiguous()}); the checkpoint holds {record.dtype} {record.shape}: "
            "pass a contiguous CPU tensor of that dtype and shape, or leave it out to allocate one")


def read_shard_into(stream: BinaryIO, dest: torch.Tensor, piece: Piece, name: str, expected: FileRecord,
                    where: str) -> None:
    """Read one shard from ``stream`` straight into ``dest`` (the piece's 1-D view), verifying as it goes.

    Raises ``CheckpointCorruptedError`` naming the file when its header, length or SHA-256 is wrong.
    ``dest`` may hold partial data after a failure.
    """
    sha = hashlib.sha256()
    head = _read_exact(stream, 8, where)
    sha.update(head)
    header_len = struct.unpack("<Q", head)[0]
    if header_len > _MAX_HEADER_BYTES:
        raise CheckpointCorruptedError(f"{where} has a corrupted header")
    header_raw = _read_exact(stream, header_len, where)
    sha.update(header_raw)
    _check_header(header_raw, dest, name, piece, where)
    data = _bytes_view(dest)
    for pos in range(0, len(data), BLOCK_BYTES):
        block = data[pos:pos + BLOCK_BYTES]
        _readinto_exact(stream, block, where)
        sha.update(block)
    if stream.read(1):
        raise CheckpointCorruptedError(f"{where} is longer than its header says")
    if sha.hexdigest() != expected.sha256:
        raise CheckpointCorruptedError(f"{where} fails its SHA-256 check (the file is corrupted)")


def _check_header(header_raw: bytes, dest: torch.Tensor, name: str, piece: Piece, where: str) -> None:
    try:
        entry = json.loads(header_raw)[name]
        ok = (entry["dtype"] == _ST_DTYPES[dest.dtype] and entry["shape"] == [piece.numel]
              and entry["data_offsets"] == [0, piece.numel * dest.element_size()])
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise CheckpointCorruptedError(f"{where} does not hold {name}[{piece.start}:+{piece.numel}] "
                                       "as the manifest says")


def _read_exact(stream: BinaryIO, n: int, where: str) -> bytes:
    buf = bytearray(n)
    _readinto_exact(stream, memoryview(buf), where)
    return bytes(buf)


def _readinto_exact(stream: BinaryIO, view: memoryview, where: str) -> None:
    got = 0
    while got < len(view):
        n = stream.readinto(view[got:])
        if not n:
            raise CheckpointCorruptedError(f"{where} is truncated")
        got += n


def _bytes_view(flat: torch.Tensor) -> memoryview:
    """The tensor's memory as writable bytes, without copying (any dtype, via a uint8 view)."""
    return memoryview(flat.detach().view(torch.uint8).numpy()).cast("B") if flat.numel() else memoryview(b"")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _torch_dtype(name: str) -> torch.dtype:
    if name not in _TORCH_DTYPES:
        raise CheckpointCorruptedError(f"manifest names unknown dtype {name!r}")
    return _TORCH_DTYPES[name]
