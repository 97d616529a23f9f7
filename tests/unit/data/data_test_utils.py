"""Helpers for the data-pipeline tests (a uniquely named module: test dirs have no __init__)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_registry(folder: Path, entries: dict[str, Any]) -> Path:
    """Write ``dataset_info.json`` into ``folder`` and return its path."""
    path = folder / "dataset_info.json"
    path.write_text(json.dumps(entries), encoding="utf-8")
    return path


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
