"""The registry reads LLaMA-Factory's dataset_info.json as LLaMA-Factory does, and says
clearly why an entry cannot be used offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from data_test_utils import write_jsonl, write_registry

from mt_ray.data.registry import Columns, Tags, load_registry
from mt_ray.errors import DatasetError

REMOTE_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")


def test_defaults_and_explicit_columns_follow_llamafactory(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", [])
    reg = load_registry(write_registry(tmp_path, {
        "plain": {"file_name": "a.jsonl"},
        "orca": {"file_name": "a.jsonl", "columns": {"prompt": "question", "response": "response", "system": "sys"}},
        "chat": {"file_name": "a.jsonl", "formatting": "sharegpt", "columns": {"messages": "messages"},
                 "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}},
        "text": {"file_name": "a.jsonl", "columns": {"prompt": "text"}},
    }))
    plain = reg.resolve("plain")
    assert (plain.formatting, plain.columns, plain.tags) == ("alpaca", Columns(), Tags())
    # Listing columns unsets the unlisted ones (query/history), exactly as LLaMA-Factory's set_attr does.
    assert reg.resolve("orca").columns == Columns(prompt="question", query=None, response="response",
                                                  messages=None, system="sys")
    chat = reg.resolve("chat")
    assert chat.formatting == "sharegpt"
    assert chat.tags == Tags(role_tag="role", content_tag="content", user_tag="user", assistant_tag="assistant",
                             observation_tag=None, function_tag=None, system_tag=None)
    assert reg.resolve("text").formatting == "text"


def test_registry_folder_or_file_and_relative_paths(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "sub" / "a.jsonl", [])
    write_registry(tmp_path, {"x": {"file_name": "sub/a.jsonl"}, "d": {"file_name": "sub"}})
    for where in (tmp_path, tmp_path / "dataset_info.json"):
        reg = load_registry(where)
        assert reg.resolve("x").path == tmp_path / "sub" / "a.jsonl"
        assert reg.resolve("d").path == tmp_path / "sub"


@pytest.mark.parametrize("key", REMOTE_KEYS)
def test_remote_entries_are_not_available_offline(tmp_path: Path, key: str) -> None:
    reg = load_registry(write_registry(tmp_path, {"remote_ds": {key: "org/name"}}))
    with pytest.raises(DatasetError, match="dataset 'remote_ds' is on a hub and not available offline; download"):
        reg.resolve("remote_ds")


def test_hub_entry_with_local_copy_uses_the_file(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", [])
    reg = load_registry(write_registry(tmp_path, {"x": {"hf_hub_url": "org/x", "file_name": "a.jsonl"}}))
    assert reg.resolve("x").path == tmp_path / "a.jsonl"


@pytest.mark.parametrize(("info", "message"), [
    ({"file_name": "missing.json"}, "file_name 'missing.json' not found"),
    ({"file_name": "a.jsonl", "ranking": True}, "ranking dataset but its columns name no chosen and rejected"),
    ({"file_name": "a.jsonl", "formatting": "sharegpt", "columns": {"messages": "m", "videos": "v"}},
     r"columns \['videos'\], which are not supported"),
    ({"file_name": "a.jsonl", "formatting": "openai"}, "formatting 'openai' is not supported"),
    ({"file_name": "a.jsonl", "columns": {"query": "q"}}, "needs columns.prompt"),
    ({"file_name": "a.jsonl", "formatting": "sharegpt", "columns": {"tools": "t"}}, "need a messages column"),
    ({}, "has no file_name"),
])
def test_unusable_entries_name_the_problem(tmp_path: Path, info: dict, message: str) -> None:
    write_jsonl(tmp_path / "a.jsonl", [])
    reg = load_registry(write_registry(tmp_path, {"bad": info}))
    with pytest.raises(DatasetError, match=message) as e:
        reg.resolve("bad")
    assert "'bad'" in str(e.value)


def test_unknown_name_suggests_close_matches(tmp_path: Path) -> None:
    reg = load_registry(write_registry(tmp_path, {"alpaca_en_demo": {"file_name": "x"}}))
    with pytest.raises(DatasetError, match="Did you mean alpaca_en_demo"):
        reg.resolve("alpaca_en_dem")


def test_bad_registry_files(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="not found"):
        load_registry(tmp_path)
    (tmp_path / "dataset_info.json").write_text("{oops")
    with pytest.raises(DatasetError, match="not valid JSON"):
        load_registry(tmp_path)
    (tmp_path / "dataset_info.json").write_text(json.dumps({"x": 1}))
    with pytest.raises(DatasetError, match="must map dataset names to objects"):
        load_registry(tmp_path)


def test_llamafactory_registry_hub_entries_name_themselves(llamafactory_dir: Path) -> None:
    reg = load_registry(llamafactory_dir)
    hub = [n for n, info in reg.entries.items() if "file_name" not in info]
    assert len(hub) > 50
    for name in hub:
        with pytest.raises(DatasetError, match=f"dataset '{name}' is on a hub and not available offline"):
            reg.resolve(name)
