"""Row-by-row readers for the file types LLaMA-Factory accepts.

Every reader streams: JSONL and ``.txt`` line by line, Parquet and Arrow one record
batch at a time, so a dataset larger than RAM never loads whole. The exception is a
``.json`` file holding one JSON array, which the standard library can only parse whole;
convert such a file to JSONL (one object per line) if it does not fit in memory. A
``.json`` file whose first character is not ``[`` is read as JSON Lines, as Hugging Face
``datasets`` does.

Readers can start at a row offset without decoding the rows they skip, which is what
lets the loader resume mid-epoch cheaply. A row that cannot be decoded is yielded with
its ``error`` set, so the caller decides whether to raise or skip it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mt_ray.errors import DatasetError

_ARROW_FILE_MAGIC = b"ARROW1"


@dataclass(frozen=True)
class RawRow:
    """One row as read: ``row`` is 1-based (the line number for JSONL and text files)."""

    file: Path
    row: int
    data: dict[str, Any] | None
    error: str | None = None


def list_files(path: Path) -> list[Path]:
    """The data files of a file or folder entry, in a stable (sorted) order."""
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    for file in files:
        if file.suffix not in _READERS:
            raise DatasetError(f"{file}: unsupported file type '{file.suffix}' (use {sorted(_READERS)})")
    if not files:
        raise DatasetError(f"{path}: folder holds no data files")
    return files


def iter_rows(path: Path, skip: int = 0) -> Iterator[RawRow]:
    """Rows of every file of ``path`` in order, starting after the first ``skip`` rows."""
    for file in list_files(path):
        read, count = _READERS[file.suffix]
        if skip:
            n = count(file)
            if skip >= n:
                skip -= n
                continue
        yield from read(file, skip)
        skip = 0


def count_rows(path: Path) -> int:
    """Rows of every file of ``path`` (the indices ``iter_rows`` walks), without decoding them."""
    return sum(_READERS[file.suffix][1](file) for file in list_files(path))


def _iter_lines(file: Path) -> Iterator[tuple[int, bytes]]:
    """Non-blank lines with their 1-based line numbers; blank lines are not rows."""
    with file.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                yield lineno, line


def _count_lines(file: Path) -> int:
    return sum(1 for _ in _iter_lines(file))


def _read_jsonl(file: Path, skip: int) -> Iterator[RawRow]:
    for i, (lineno, line) in enumerate(_iter_lines(file)):
        if i >= skip:
            yield _decode_json(file, lineno, line)


def _decode_json(file: Path, lineno: int, line: bytes) -> RawRow:
    try:
        data = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return RawRow(file, lineno, None, f"invalid JSON: {e}")
    if not isinstance(data, dict):
        return RawRow(file, lineno, None, f"expected a JSON object, got {type(data).__name__}")
    return RawRow(file, lineno, data)


def _read_text(file: Path, skip: int) -> Iterator[RawRow]:
    for i, (lineno, line) in enumerate(_iter_lines(file)):
        if i < skip:
            continue
        try:
            yield RawRow(file, lineno, {"text": line.decode("utf-8").rstrip("\r\n")})
        except UnicodeDecodeError as e:
            yield RawRow(file, lineno, None, f"not UTF-8: {e}")


def _is_json_array(file: Path) -> bool:
    with file.open("rb") as f:
        while chunk := f.read(4096):
            stripped = chunk.lstrip()
            if stripped:
                return stripped[:1] == b"["
    return False


def _load_json_array(file: Path) -> list[Any]:
    try:
        return json.loads(file.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetError(f"{file}: invalid JSON: {e}") from e


def _read_json(file: Path, skip: int) -> Iterator[RawRow]:
    if not _is_json_array(file):
        yield from _read_jsonl(file, skip)
        return
    for i, data in enumerate(_load_json_array(file)[skip:], start=skip + 1):
        if isinstance(data, dict):
            yield RawRow(file, i, data)
        else:
            yield RawRow(file, i, None, f"expected a JSON object, got {type(data).__name__}")


def _count_json(file: Path) -> int:
    return len(_load_json_array(file)) if _is_json_array(file) else _count_lines(file)


def _read_parquet(file: Path, skip: int) -> Iterator[RawRow]:
    pf = pq.ParquetFile(file)
    first_group, row = 0, 0
    while first_group < pf.num_row_groups and row + pf.metadata.row_group(first_group).num_rows <= skip:
        row += pf.metadata.row_group(first_group).num_rows
        first_group += 1
    groups = list(range(first_group, pf.num_row_groups))
    if groups:
        yield from _rows_of_batches(file, pf.iter_batches(row_groups=groups), row, skip)


def _count_parquet(file: Path) -> int:
    return pq.ParquetFile(file).metadata.num_rows


def _open_arrow(file: Path) -> Iterator[pa.RecordBatch]:
    """Record batches of an Arrow IPC file or stream (memory-mapped, so zero-copy)."""
    source = pa.memory_map(str(file))
    try:
        if source.read(len(_ARROW_FILE_MAGIC)) == _ARROW_FILE_MAGIC:
            reader = pa.ipc.open_file(source)
            yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            source.seek(0)
            yield from pa.ipc.open_stream(source)
    except pa.ArrowInvalid as e:
        raise DatasetError(f"{file}: not an Arrow IPC file or stream: {e}") from e
    finally:
        source.close()


def _read_arrow(file: Path, skip: int) -> Iterator[RawRow]:
    yield from _rows_of_batches(file, _open_arrow(file), 0, skip)


def _count_arrow(file: Path) -> int:
    return sum(batch.num_rows for batch in _open_arrow(file))


def _rows_of_batches(file: Path, batches: Iterator[pa.RecordBatch], first: int, skip: int) -> Iterator[RawRow]:
    """Rows of ``batches`` whose first row is row ``first``; decodes only batches past ``skip``."""
    row = first
    for batch in batches:
        if row + batch.num_rows <= skip:
            row += batch.num_rows
            continue
        for data in batch.to_pylist():
            row += 1
            if row > skip:
                yield RawRow(file, row, data)


_Reader = Callable[[Path, int], Iterator[RawRow]]
_READERS: dict[str, tuple[_Reader, Callable[[Path], int]]] = {
    ".json": (_read_json, _count_json),
    ".jsonl": (_read_jsonl, _count_lines),
    ".txt": (_read_text, _count_lines),
    ".parquet": (_read_parquet, _count_parquet),
    ".arrow": (_read_arrow, _count_arrow),
}
