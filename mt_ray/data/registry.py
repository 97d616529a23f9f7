"""Reads a LLaMA-Factory ``dataset_info.json`` and resolves entries to local files.

The registry is read exactly as LLaMA-Factory reads it, so its own files work unchanged:

* ``formatting`` is ``alpaca`` (default) or ``sharegpt``;
* without a ``columns`` key the format's default columns apply; with one, only the
  columns it lists are used (the others are unset), and likewise for ``tags``;
* an alpaca entry with no ``response`` column is plain text for pretraining, which is
  how LLaMA-Factory marks ``c4_demo``/``wiki_demo`` (``columns: {prompt: text}``);
* ``file_name`` is a file or a folder, relative to the registry's folder.

An ``images`` column (multimodal SFT, as LLaMA-Factory's ``mllm_demo``) lists each row's image
files, relative to the registry's folder, one per ``<image>`` placeholder in the text.
Preference entries are read as LLaMA-Factory reads them too: ``ranking: true`` with ``chosen`` and
``rejected`` columns (sharegpt: each a turn object; alpaca: each a response string) trains under
``training.stage: dpo``, and a ``kto_tag`` column (a boolean per row) under ``stage: kto``; the
entry's ``kind`` says which stage it fits. Hub, script and cloud entries cannot load offline and
raise ``DatasetError``; so do video and audio entries. A hub entry that also names a ``file_name``
uses the local copy.

A dataset named by a local file or folder path instead of an entry is read in LLaMA-Factory v1's standard
format, as its ``--dataset path`` reads one (``llamafactory.v1``'s ``SFTSample`` and ``DPOSample``): rows of
``messages``, or of ``chosen_messages`` and ``rejected_messages`` (a ranking dataset), each a list of
``{role, content: [{type, value}], loss_weight}``; its first row says which.
"""

from __future__ import annotations

import difflib
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mt_ray.data.readers import RawRow, count_rows, iter_rows
from mt_ray.errors import DatasetError

Formatting = Literal["alpaca", "sharegpt", "text", "v1"]
Kind = Literal["sft", "ranking", "kto"]
STAGE_OF_KIND: dict[str, str] = {"sft": "sft", "ranking": "dpo", "kto": "kto"}
"""The ``training.stage`` each kind of entry trains under (LLaMA-Factory's stage names)."""
REGISTRY_FILE = "dataset_info.json"
_REMOTE_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
_UNSUPPORTED_COLUMNS = ("videos", "audios")
_COLUMN_NAMES = ("prompt", "query", "response", "history", "messages", "system", "tools", "images",
                 "chosen", "rejected", "kto_tag")
_TAG_NAMES = ("role_tag", "content_tag", "user_tag", "assistant_tag", "observation_tag",
              "function_tag", "system_tag")


@dataclass(frozen=True)
class Columns:
    """Which row key holds each field (``None`` = not used). Defaults are LLaMA-Factory's."""

    prompt: str | None = "instruction"
    query: str | None = "input"
    response: str | None = "output"
    history: str | None = None
    messages: str | None = "conversations"
    system: str | None = None
    tools: str | None = None
    images: str | None = None
    chosen: str | None = None
    rejected: str | None = None
    kto_tag: str | None = None


@dataclass(frozen=True)
class Tags:
    """ShareGPT keys and role values (``None`` = role not accepted). Defaults are LLaMA-Factory's."""

    role_tag: str | None = "from"
    content_tag: str | None = "value"
    user_tag: str | None = "human"
    assistant_tag: str | None = "gpt"
    observation_tag: str | None = "observation"
    function_tag: str | None = "function_call"
    system_tag: str | None = "system"


@dataclass(frozen=True)
class DatasetEntry:
    """One resolved registry entry: a local file or folder and how to read its rows."""

    name: str
    path: Path
    formatting: Formatting
    columns: Columns
    tags: Tags
    media_dir: Path | None = None
    """The folder image paths are relative to: the registry's (LLaMA-Factory's default ``media_dir``)."""
    kind: Kind = "sft"
    """``ranking`` (chosen/rejected pairs, stage dpo), ``kto`` (rows tagged desirable or not) or ``sft``."""
    max_rows: int | None = None
    """Only the first this many rows in file order are the dataset (``data.max_samples``, LLaMA-Factory's)."""

    def rows(self, skip: int = 0) -> Iterator[RawRow]:
        """The dataset's rows in file order from row ``skip`` on (at most ``max_rows`` in all)."""
        rows = iter_rows(self.path, skip=skip)
        return rows if self.max_rows is None else itertools.islice(rows, max(self.max_rows - skip, 0))

    def num_rows(self) -> int:
        """How many rows ``rows()`` walks, without decoding them."""
        total = count_rows(self.path)
        return total if self.max_rows is None else min(total, self.max_rows)

    @property
    def stage(self) -> str:
        """The ``training.stage`` this entry trains under."""
        return STAGE_OF_KIND[self.kind]

    def check_stage(self, stage: str) -> None:
        """Refuse, in one line, an entry that does not fit ``stage``."""
        if stage != self.stage:
            what = {"sft": "an SFT", "ranking": "a preference (ranking)", "kto": "a KTO (kto_tag)"}[self.kind]
            raise DatasetError(f"dataset '{self.name}' is {what} dataset, which trains under training.stage: "
                               f"{self.stage}, not {stage}")


@dataclass(frozen=True)
class Registry:
    """The parsed ``dataset_info.json``; ``folder`` anchors relative ``file_name`` paths."""

    folder: Path
    entries: dict[str, dict[str, Any]]

    def resolve(self, name: str) -> DatasetEntry:
        """Turn entry ``name`` into a ``DatasetEntry``, or say why it cannot be used."""
        if name not in self.entries and Path(name).exists():
            return v1_entry(name)
        if name not in self.entries:
            close = difflib.get_close_matches(name, list(self.entries), n=3)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise DatasetError(f"dataset '{name}' is not in {self.folder / REGISTRY_FILE} and is no local file "
                               f"(LLaMA-Factory v1's format).{hint}")
        info = self.entries[name]
        _check_supported(name, info)
        path = self.folder / info["file_name"]
        if not path.exists():
            raise DatasetError(f"dataset '{name}': file_name '{info['file_name']}' not found at {path}")
        columns = _columns(info)
        kind = _kind(name, info, columns)
        formatting = _formatting(name, info, columns, kind)
        return DatasetEntry(name=name, path=path, formatting=formatting, columns=columns, tags=_tags(info),
                            media_dir=self.folder, kind=kind)


V1_COLUMNS = Columns(prompt=None, query=None, response=None, messages="messages", tools="tools",
                     chosen="chosen_messages", rejected="rejected_messages")
"""The keys of LLaMA-Factory v1's standard rows (``SFTSample``, ``DPOSample``)."""


def v1_entry(name: str) -> DatasetEntry:
    """A local file or folder in LLaMA-Factory v1's standard format: a ranking dataset when its first row holds
    ``chosen_messages`` or ``rejected_messages`` (v1's ``DPOSample``), an SFT one when it holds ``messages``."""
    path = Path(name)
    first = next((row for row in iter_rows(path) if row.data is not None), None)
    keys = set(first.data) if first else set()
    if {V1_COLUMNS.chosen, V1_COLUMNS.rejected} & keys:
        kind: Kind = "ranking"
    elif V1_COLUMNS.messages in keys:
        kind = "sft"
    else:
        where = f"{first.file} row {first.row}" if first else "it holds no readable row, so it"
        raise DatasetError(f"dataset '{name}': {where} is not in LLaMA-Factory v1's format (a 'messages' list, or "
                           "'chosen_messages' and 'rejected_messages'); register it in a dataset_info.json instead")
    return DatasetEntry(name=name, path=path, formatting="v1", columns=V1_COLUMNS, tags=Tags(), media_dir=path.parent,
                        kind=kind)


def load_registry(path: str | Path) -> Registry:
    """Parse a registry given as the ``dataset_info.json`` file or the folder holding it."""
    path = Path(path)
    file = path / REGISTRY_FILE if path.is_dir() else path
    try:
        entries = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise DatasetError(f"dataset registry not found: {file}") from e
    except json.JSONDecodeError as e:
        raise DatasetError(f"dataset registry {file} is not valid JSON: {e}") from e
    if not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values()):
        raise DatasetError(f"dataset registry {file} must map dataset names to objects")
    return Registry(folder=file.parent, entries=entries)


def _check_supported(name: str, info: dict[str, Any]) -> None:
    if "file_name" not in info:
        if any(key in info for key in _REMOTE_KEYS):
            raise DatasetError(
                f"dataset '{name}' is on a hub and not available offline; "
                "download it and point file_name at the local copy"
            )
        raise DatasetError(f"dataset '{name}' has no file_name")
    used = [c for c in _UNSUPPORTED_COLUMNS if c in info.get("columns", {})]
    if used:
        raise DatasetError(f"dataset '{name}' uses columns {used}, which are not supported (text and images)")


def _kind(name: str, info: dict[str, Any], columns: Columns) -> Kind:
    if info.get("ranking"):
        if not (columns.chosen and columns.rejected):
            raise DatasetError(f"dataset '{name}' is a ranking dataset but its columns name no chosen and rejected "
                               "columns; add them to its entry (columns: {chosen: ..., rejected: ...})")
        if columns.images:
            raise DatasetError(f"dataset '{name}': preference training on images is not supported yet")
        return "ranking"
    if columns.kto_tag:
        if columns.images:
            raise DatasetError(f"dataset '{name}': preference training on images is not supported yet")
        return "kto"
    return "sft"


def _columns(info: dict[str, Any]) -> Columns:
    if "columns" not in info:
        return Columns()
    return Columns(**{key: info["columns"].get(key) for key in _COLUMN_NAMES})


def _tags(info: dict[str, Any]) -> Tags:
    if "tags" not in info:
        return Tags()
    return Tags(**{key: info["tags"].get(key) for key in _TAG_NAMES})


def _formatting(name: str, info: dict[str, Any], columns: Columns, kind: Kind) -> Formatting:
    formatting = info.get("formatting", "alpaca")
    if formatting == "sharegpt":
        tags = _tags(info)
        if not (columns.messages and tags.role_tag and tags.content_tag):
            raise DatasetError(f"dataset '{name}': sharegpt entries need a messages column, role_tag and content_tag")
        return "sharegpt"
    if formatting != "alpaca":
        raise DatasetError(f"dataset '{name}': formatting '{formatting}' is not supported (alpaca or sharegpt)")
    if kind == "ranking":
        return "alpaca"  # the responses are the chosen and rejected columns
    if columns.response is None:
        if columns.prompt is None:
            raise DatasetError(f"dataset '{name}': a text dataset needs columns.prompt (the text column)")
        return "text"
    return "alpaca"
