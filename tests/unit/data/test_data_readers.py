"""Every supported file type streams the same rows, skips rows without decoding, and
reports undecodable rows with their file and row number."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_test_utils import write_jsonl

from mt_ray.data.readers import iter_rows, list_files
from mt_ray.errors import DatasetError

ROWS = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(7)]


def write_json_array(path: Path) -> Path:
    path.write_text(json.dumps(ROWS, indent=2), encoding="utf-8")
    return path


def write_parquet(path: Path) -> Path:
    pq.write_table(pa.Table.from_pylist(ROWS), path, row_group_size=3)
    return path


def write_arrow(path: Path, new_writer=pa.ipc.new_file) -> Path:
    """Arrow IPC in record batches of 2 rows: the file format, or the stream format with `pa.ipc.new_stream`."""
    table = pa.Table.from_pylist(ROWS)
    with pa.OSFile(str(path), "wb") as sink, new_writer(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=2):
            writer.write_batch(batch)
    return path


def write_arrow_stream(path: Path) -> Path:
    return write_arrow(path, pa.ipc.new_stream)


WRITERS = {
    "data.json": write_json_array,
    "data.jsonl": lambda p: write_jsonl(p, ROWS),
    "lines.json": lambda p: write_jsonl(p, ROWS),
    "data.parquet": write_parquet,
    "file.arrow": write_arrow,
    "stream.arrow": write_arrow_stream,
}


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_each_file_type_yields_all_rows_in_order(tmp_path: Path, name: str) -> None:
    path = WRITERS[name](tmp_path / name)
    rows = list(iter_rows(path))
    assert [r.data for r in rows] == ROWS
    assert [r.row for r in rows] == list(range(1, 8))
    assert all(r.file == path and r.error is None for r in rows)


@pytest.mark.parametrize("name", sorted(WRITERS))
@pytest.mark.parametrize("skip", [0, 2, 3, 6, 7])
def test_skip_starts_at_the_right_row(tmp_path: Path, name: str, skip: int) -> None:
    path = WRITERS[name](tmp_path / name)
    assert [r.data for r in iter_rows(path, skip=skip)] == ROWS[skip:]


def test_text_file_is_one_example_per_nonblank_line(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_text("first line\n\nsecond line\r\nthird\n", encoding="utf-8")
    rows = list(iter_rows(path))
    assert [r.data for r in rows] == [{"text": "first line"}, {"text": "second line"}, {"text": "third"}]
    assert [r.row for r in rows] == [1, 3, 4]


def test_directory_reads_mixed_files_in_name_order_and_skips_across_them(tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    folder.mkdir()
    write_parquet(folder / "b.parquet")
    write_jsonl(folder / "a.jsonl", ROWS[:2])
    write_arrow_stream(folder / "c.arrow")
    (folder / ".hidden").write_text("ignored")
    assert [p.name for p in list_files(folder)] == ["a.jsonl", "b.parquet", "c.arrow"]
    rows = list(iter_rows(folder))
    assert [r.data for r in rows] == ROWS[:2] + ROWS + ROWS
    assert [r.data for r in iter_rows(folder, skip=4)] == (ROWS[:2] + ROWS + ROWS)[4:]
    assert rows[2].file.name == "b.parquet" and rows[2].row == 1


def test_bad_jsonl_lines_are_reported_with_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n\n{not json\n[1, 2]\n', encoding="utf-8")
    rows = list(iter_rows(path))
    assert [(r.row, r.data is None) for r in rows] == [(1, False), (3, True), (4, True)]
    assert "invalid JSON" in rows[1].error and "expected a JSON object" in rows[2].error


def test_unsupported_extension_and_empty_folder_raise(tmp_path: Path) -> None:
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unsupported file type '.csv'"):
        list_files(tmp_path / "x.csv")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DatasetError, match="no data files"):
        list_files(empty)


def test_broken_json_array_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('[{"a": 1},', encoding="utf-8")
    with pytest.raises(DatasetError, match="broken.json: invalid JSON"):
        list(iter_rows(path))
