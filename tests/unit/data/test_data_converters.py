"""Rows convert into the one schema, and every malformed row is named by file and row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mt_ray.data.converters import convert_row
from mt_ray.data.readers import RawRow
from mt_ray.data.registry import V1_COLUMNS, Columns, DatasetEntry, Tags
from mt_ray.data.schema import ChatExample, Message, TextExample
from mt_ray.errors import DatasetError

FILE = Path("/data/train.jsonl")
ALPACA = DatasetEntry("alp", FILE, "alpaca", Columns(system="system", history="history"), Tags())
SHAREGPT = DatasetEntry("sg", FILE, "sharegpt", Columns(messages="conversations", system="system", tools="tools"),
                        Tags())
OPENAI_TAGS = Tags(role_tag="role", content_tag="content", user_tag="user", assistant_tag="assistant",
                   observation_tag=None, function_tag=None, system_tag="system")
OPENAI = DatasetEntry("oa", FILE, "sharegpt", Columns(messages="messages"), OPENAI_TAGS)
TEXT = DatasetEntry("txt", FILE, "text", Columns(prompt="text", query=None, response=None), Tags())
CALL = json.dumps({"name": "multiply", "arguments": {"a": 2, "b": 3}})
V1 = DatasetEntry("v1", FILE, "v1", V1_COLUMNS, Tags())


def convert(entry: DatasetEntry, data: dict | None, row: int = 7):
    return convert_row(entry, RawRow(FILE, row, data, None if data is not None else "invalid JSON: x"))


def turns(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [{"from": r, "value": v} for r, v in pairs]


def test_alpaca_joins_instruction_and_input_and_keeps_history_and_system() -> None:
    ex = convert(ALPACA, {"instruction": "Add.", "input": "2 3", "output": "5", "system": "Be brief.",
                          "history": [["Hi", "Hello"]]})
    assert ex == ChatExample(
        messages=(Message("user", "Hi"), Message("assistant", "Hello"),
                  Message("user", "Add.\n2 3"), Message("assistant", "5")),
        system="Be brief.")
    assert convert(ALPACA, {"instruction": "Hi", "input": "", "output": "Yo"}).messages[0] == Message("user", "Hi")


def test_sharegpt_multi_turn_with_system_tools_and_function_calls() -> None:
    tools = json.dumps([{"name": "multiply"}])
    conv = turns(("system", "Sys"), ("human", "2*3?"), ("function_call", CALL), ("observation", '{"r": 6}'),
                 ("gpt", "6"), ("human", "Thanks"), ("gpt", "Welcome"))
    ex = convert(SHAREGPT, {"conversations": conv, "tools": tools})
    assert ex.system == "Sys" and ex.tools == ({"name": "multiply"},)
    assert [m.role for m in ex.messages] == ["user", "function_call", "observation", "assistant", "user", "assistant"]
    with_column = convert(SHAREGPT, {"conversations": turns(("human", "a"), ("gpt", "b")), "system": "S"})
    assert with_column.system == "S" and with_column.tools is None


def test_role_content_tags_and_text() -> None:
    ex = convert(OPENAI, {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "u"},
                                       {"role": "assistant", "content": "a"}]})
    assert ex == ChatExample(messages=(Message("user", "u"), Message("assistant", "a")), system="S")
    assert convert(TEXT, {"text": "Some text."}) == TextExample("Some text.")


BAD_ROWS = [
    (ALPACA, {"input": "", "output": "x"}, "empty prompt"),
    (ALPACA, {"instruction": "q", "input": ""}, "missing column 'output'"),
    (ALPACA, {"instruction": "q", "output": ""}, "column 'output' is empty"),
    (ALPACA, {"instruction": 5, "output": "x"}, "column 'instruction' must be a string, got int"),
    (ALPACA, {"instruction": "q", "output": "x", "history": [["only one"]]}, "pairs"),
    (ALPACA, {"instruction": "q", "output": "x", "history": "nope"}, "must be a list"),
    (SHAREGPT, {"conversations": []}, "non-empty list of turns"),
    (SHAREGPT, {"other": 1}, "non-empty list of turns"),
    (SHAREGPT, {"conversations": turns(("system", "S"))}, "system prompt but no turns"),
    (SHAREGPT, {"conversations": turns(("human", "a"), ("human", "b"), ("gpt", "c"))},
     "turn 1: role 'human' out of order"),
    (SHAREGPT, {"conversations": turns(("gpt", "a"), ("human", "b"))}, "turn 0: role 'gpt' out of order"),
    (SHAREGPT, {"conversations": turns(("human", "a"), ("gpt", "b"), ("human", "c"))},
     "ends on a 'user' turn"),
    (SHAREGPT, {"conversations": turns(("human", "a"), ("robot", "b"))}, "unknown role 'robot'"),
    (SHAREGPT, {"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "b"}]},
     "content 'value' must be a string, got int"),
    (SHAREGPT, {"conversations": [{"from": "human"}, {"from": "gpt", "value": "b"}]}, "got missing"),
    (SHAREGPT, {"conversations": ["hi", "there"]}, "turn 0 must be an object"),
    (SHAREGPT, {"conversations": turns(("human", "a"), ("function_call", "not json"))}, "not valid JSON"),
    (SHAREGPT, {"conversations": turns(("human", "a"), ("function_call", '{"args": 1}'))}, '"name"'),
    (SHAREGPT, {"conversations": turns(("human", "a"), ("gpt", "b")), "tools": "{bad"}, "'tools' is not valid JSON"),
    (SHAREGPT, {"conversations": turns(("human", "a"), ("gpt", "b")), "tools": "[1]"}, "list of tool schemas"),
    (OPENAI, {"messages": [{"role": "user", "content": "u"}, {"role": "tool", "content": "t"}]}, "unknown role"),
    (TEXT, {"text": "   "}, "column 'text' is empty"),
    (TEXT, {"content": "x"}, "missing column 'text'"),
    (TEXT, None, "invalid JSON"),
]


@pytest.mark.parametrize(("entry", "data", "message"), BAD_ROWS)
def test_malformed_rows_name_dataset_file_and_row(entry: DatasetEntry, data: dict | None, message: str) -> None:
    with pytest.raises(DatasetError, match=message) as e:
        convert(entry, data, row=42)
    assert str(e.value).startswith(f"dataset '{entry.name}': {FILE} row 42: ")


def v1_message(role: str, *parts: tuple[str, str], **extra) -> dict:
    return {"role": role, "content": [{"type": t, "value": v} for t, v in parts], **extra}


def test_llamafactory_v1_tool_calls_and_results() -> None:
    messages = [v1_message("system", ("text", "Be brief."), loss_weight=0.0), v1_message("user", ("text", "2*3?")),
                v1_message("assistant", ("tool_call", CALL)), v1_message("tool", ("text", "6")),
                v1_message("assistant", ("text", "Six"), ("text", "."), loss_weight=1.0)]
    ex = convert(V1, {"messages": messages, "tools": json.dumps([{"name": "m"}])})
    call = Message("function_call", json.dumps([json.loads(CALL)]))
    assert ex == ChatExample(messages=(Message("user", "2*3?"), call, Message("observation", "6"),
                                       Message("assistant", "Six.")), system="Be brief.", tools=({"name": "m"},))
    with pytest.raises(DatasetError, match=r"train.jsonl row 7: 'messages' message 1: content of type "
                                           r"\['reasoning'\] is not supported"):
        convert(V1, {"messages": [v1_message("user", ("text", "q")), v1_message("assistant", ("reasoning", "r"))]})
