"""Converts raw rows (alpaca, sharegpt, plain text) into the schema of ``schema.py``.

Conversion is where rows are validated: a row with a missing field, a wrong type, an
empty conversation or roles out of order raises ``DatasetError`` naming the file and
row, before it can ever turn into a wrong label mask. The rules follow LLaMA-Factory's
converters: prompt-side turns (user, observation) and response-side turns (assistant,
function_call) must alternate, starting with the prompt side and ending with the
response side. A row's images must exist and open as images, one per ``<image>``
placeholder, all in prompt-side turns (they are decoded later, in the loader's worker).

Preference rows (LLaMA-Factory's ranking and KTO entries): a ranking row's conversation ends on a
prompt-side turn and its ``chosen`` and ``rejected`` columns hold the two responses (sharegpt: turn
objects with a response-side role; alpaca: strings), giving a ``PairExample``; a KTO row is an SFT
row whose ``kto_tag`` column is true or false, giving a ``FeedbackExample``.

LLaMA-Factory v1's rows (``formatting: v1``, see registry.py) are read as its trainers read them: a pair's
prompt is every message before the last (masked whatever its ``loss_weight``), its response the last message,
scored when that message's ``loss_weight`` is above 0; an SFT row trains each assistant message of weight 1.
What v1 can say but mt-ray cannot train exactly is refused by name: other assistant weights, chosen and
rejected prompts that differ, content that is not text or tool calls.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from mt_ray.data.readers import RawRow
from mt_ray.data.registry import Columns, DatasetEntry, Tags
from mt_ray.data.schema import (
    IMAGE_PLACEHOLDER,
    PROMPT_ROLES,
    RESPONSE_ROLES,
    ChatExample,
    Example,
    FeedbackExample,
    Message,
    PairExample,
    Role,
    TextExample,
)
from mt_ray.errors import DatasetError


class _RowProblem(Exception):
    """What is wrong with a row; ``convert_row`` adds the file and row number."""


def convert_row(entry: DatasetEntry, raw: RawRow) -> Example:
    """Convert one row of ``entry``; raise ``DatasetError`` ("<file> row <n>: why") if malformed."""
    try:
        if raw.data is None:
            raise _RowProblem(raw.error or "unreadable row")
        if entry.formatting == "v1":
            return _convert_v1(entry.columns, raw.data, entry.kind == "ranking")
        if entry.formatting == "text":
            return TextExample(text=_required_str(raw.data, entry.columns.prompt, allow_empty=False))
        if entry.kind == "ranking":
            return _convert_pair(entry, raw.data)
        if entry.kind == "kto":
            return FeedbackExample(_convert_chat(entry, raw), _kto_tag(entry.columns.kto_tag, raw.data))
        return _convert_chat(entry, raw)
    except _RowProblem as e:
        raise DatasetError(f"dataset '{entry.name}': {raw.file} row {raw.row}: {e}") from None


def convert_prompt(entry: DatasetEntry, raw: RawRow) -> tuple[ChatExample, dict[str, Any]]:
    """A GRPO prompt: the row's conversation up to its last prompt-side turn (a final response, where the row has
    one, is left out), and the row's other columns (`answer`, ...) for the reward functions."""
    try:
        if raw.data is None:
            raise _RowProblem(raw.error or "unreadable row")
        if entry.kind != "sft" or entry.formatting == "text" or entry.columns.images:
            raise _RowProblem("a GRPO prompt comes from a text-only alpaca or sharegpt SFT row")
        cols, data = entry.columns, raw.data
        if entry.formatting == "alpaca":
            prompt = ChatExample(messages=_alpaca_prompt(cols, data), system=_optional_str(data, cols.system))
        else:
            prompt = _sharegpt_prompt(cols, entry.tags, data)
    except _RowProblem as e:
        raise DatasetError(f"dataset '{entry.name}': {raw.file} row {raw.row}: {e}") from None
    used = {c for c in vars(cols).values() if c}
    return prompt, {k: v for k, v in data.items() if k not in used}


def _sharegpt_prompt(cols: Columns, tags: Tags, data: dict[str, Any]) -> ChatExample:
    turns = data.get(cols.messages)
    if not isinstance(turns, list) or not turns:
        raise _RowProblem(f"column '{cols.messages}' must be a non-empty list of turns")
    system, turns = _leading_system(tags, turns, _optional_str(data, cols.system))
    messages = [_sharegpt_message(turn, tags, i) for i, turn in enumerate(turns)]
    while messages and messages[-1].role in RESPONSE_ROLES:
        messages.pop()
    if not messages:
        raise _RowProblem("conversation has no prompt-side turn to sample a response to")
    return ChatExample(messages=tuple(messages), system=system, tools=_tools(data, cols.tools))


def _convert_chat(entry: DatasetEntry, raw: RawRow) -> ChatExample:
    if entry.formatting == "alpaca":
        example = _convert_alpaca(entry.columns, raw.data)
    else:
        example = _convert_sharegpt(entry.columns, entry.tags, raw.data)
    return _with_images(example, entry, raw) if entry.columns.images else example


def _convert_pair(entry: DatasetEntry, data: dict[str, Any]) -> PairExample:
    """A ranking row: the prompt conversation and its chosen and rejected responses."""
    cols, tags = entry.columns, entry.tags
    missing = [c for c in (cols.chosen, cols.rejected) if data.get(c) is None]
    if missing:
        raise _RowProblem(f"no {' or '.join(repr(c) for c in missing)} column: a ranking row needs a chosen and a "
                          "rejected response")
    if entry.formatting == "alpaca":
        prompt = _alpaca_prompt(cols, data)
        return PairExample(prompt=prompt, chosen=Message("assistant", _required_str(data, cols.chosen, False)),
                           rejected=Message("assistant", _required_str(data, cols.rejected, False)),
                           system=_optional_str(data, cols.system))
    turns = data.get(cols.messages)
    if not isinstance(turns, list) or not turns:
        raise _RowProblem(f"column '{cols.messages}' must be a non-empty list of turns")
    system, turns = _leading_system(tags, turns, _optional_str(data, cols.system))
    prompt = tuple(_sharegpt_message(turn, tags, i) for i, turn in enumerate(turns))
    if not prompt or prompt[-1].role not in PROMPT_ROLES:
        raise _RowProblem(f"a ranking conversation must end on a prompt-side turn (the responses are the "
                          f"'{cols.chosen}' and '{cols.rejected}' columns)")
    responses = [_sharegpt_message(data[c], tags, len(prompt)) for c in (cols.chosen, cols.rejected)]
    return PairExample(prompt=prompt, chosen=responses[0], rejected=responses[1], system=system,
                       tools=_tools(data, cols.tools))


def _convert_v1(cols: Columns, data: dict[str, Any], pair: bool) -> ChatExample | PairExample:
    """A LLaMA-Factory v1 row: ``messages`` (SFT), or ``chosen_messages`` and ``rejected_messages`` (a pair)."""
    tools = _tools(data, cols.tools)
    if not pair:
        system, messages, weights = _v1_conversation(data.get(cols.messages), cols.messages)
        for i, (m, w) in enumerate(zip(messages, weights, strict=True)):
            if m.role in RESPONSE_ROLES and w != 1.0:
                raise _RowProblem(f"'{cols.messages}' message {i}: loss_weight {w:g} on an assistant message; mt-ray "
                                  "trains every assistant message at weight 1")
        return ChatExample(messages=messages, system=system, tools=tools)
    missing = [c for c in (cols.chosen, cols.rejected) if data.get(c) is None]
    if missing:
        raise _RowProblem(f"no {' or '.join(repr(c) for c in missing)} column: a ranking row needs a chosen and a "
                          "rejected conversation")
    (system, chosen, c_w), (r_system, rejected, r_w) = (_v1_conversation(data[c], c)
                                                        for c in (cols.chosen, cols.rejected))
    if (system, chosen[:-1]) != (r_system, rejected[:-1]):
        raise _RowProblem(f"'{cols.chosen}' and '{cols.rejected}' differ before their last message; a pair shares "
                          "its prompt")
    if len(chosen) < 2 or min(c_w[-1], r_w[-1]) <= 0:
        raise _RowProblem("a pair's conversations need a prompt and a last assistant message of loss_weight above 0")
    return PairExample(prompt=chosen[:-1], chosen=chosen[-1], rejected=rejected[-1], system=system, tools=tools)


def _v1_conversation(turns: Any, column: str) -> tuple[str | None, tuple[Message, ...], tuple[float, ...]]:
    """The system prompt (a first system message), the messages and their loss weights (v1's defaults: 1 for
    assistant messages, 0 for the others); roles alternate as in sharegpt, ending on a response."""
    if not isinstance(turns, list) or not turns or not all(isinstance(t, dict) for t in turns):
        raise _RowProblem(f"column '{column}' must be a non-empty list of message objects")
    system = _v1_text(_v1_parts(turns[0], column, 0), column, 0) if turns[0].get("role") == "system" else None
    turns = turns[1:] if system is not None else turns
    messages, weights = [], []
    for i, turn in enumerate(turns):
        role = _V1_ROLES.get(turn.get("role"))
        expected = PROMPT_ROLES if i % 2 == 0 else RESPONSE_ROLES
        if role not in expected:
            raise _RowProblem(f"'{column}' message {i}: role {turn.get('role')!r} where {list(expected)} belongs")
        parts = _v1_parts(turn, column, i)
        if role == "assistant" and all(p["type"] == "tool_call" for p in parts):
            role = "function_call"
            text = json.dumps([call for p in parts for call in parse_function_call(p["value"])], ensure_ascii=False)
        else:
            text = _v1_text(parts, column, i)
        messages.append(Message(role, text))
        weights.append(float(turn.get("loss_weight", 1.0 if role in RESPONSE_ROLES else 0.0)))
    if not messages or messages[-1].role not in RESPONSE_ROLES:
        raise _RowProblem(f"column '{column}' must end on an assistant message")
    return system, tuple(messages), tuple(weights)


_V1_ROLES: dict[Any, Role] = {"user": "user", "tool": "observation", "assistant": "assistant"}


def _v1_parts(turn: dict[str, Any], column: str, index: int) -> list[dict[str, Any]]:
    parts = turn.get("content")
    if not isinstance(parts, list) or not parts or not all(isinstance(p, dict) and isinstance(p.get("value"), str)
                                                           for p in parts):
        raise _RowProblem(f"'{column}' message {index}: content must be a non-empty list of {{type, value}} parts")
    return parts


def _v1_text(parts: list[dict[str, Any]], column: str, index: int) -> str:
    kinds = sorted({p.get("type") for p in parts} - {"text"})
    if kinds:
        raise _RowProblem(f"'{column}' message {index}: content of type {kinds} is not supported (text, and "
                          "assistant messages of tool calls only)")
    return "".join(p["value"] for p in parts)


def _kto_tag(column: str | None, data: dict[str, Any]) -> bool:
    value = data.get(column) if column else None
    if not isinstance(value, bool):
        kind = "missing" if value is None else f"{type(value).__name__} {value!r}"
        raise _RowProblem(f"column '{column}' (the KTO tag) must be true or false, got {kind}")
    return value


def _with_images(example: ChatExample, entry: DatasetEntry, raw: RawRow) -> ChatExample:
    """The row's image files (checked to open as images), one per placeholder, in prompt-side turns only."""
    value = raw.data.get(entry.columns.images) or []
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise _RowProblem(f"column '{entry.columns.images}' must be a list of image file paths")
    placeholders = sum(m.content.count(IMAGE_PLACEHOLDER) for m in example.messages)
    if placeholders != len(names):
        raise _RowProblem(f"{placeholders} {IMAGE_PLACEHOLDER} placeholders but {len(names)} images in column "
                          f"'{entry.columns.images}'; each image needs one placeholder where it goes in the text")
    if any(IMAGE_PLACEHOLDER in m.content for m in example.messages if m.role in RESPONSE_ROLES):
        raise _RowProblem(f"an assistant turn holds {IMAGE_PLACEHOLDER}; images go in the prompt (user) turns")
    paths = tuple(_image_file(entry.media_dir / n, n) for n in names)
    return replace(example, images=paths, origin=f"dataset '{entry.name}': {raw.file} row {raw.row}")


def _image_file(path: Path, name: str) -> Path:
    try:
        with Image.open(path) as image:
            image.verify()  # the header and structure only: the pixels are decoded in the loader's worker
    except FileNotFoundError:
        raise _RowProblem(f"image '{name}' not found at {path}") from None
    except (OSError, UnidentifiedImageError, SyntaxError) as e:
        raise _RowProblem(f"image '{name}' at {path} cannot be read as an image ({e})") from None
    return path


def parse_function_call(content: str) -> list[dict[str, Any]]:
    """The calls in a function_call turn: ``{"name", "arguments"}`` objects, one or a list."""
    try:
        calls = json.loads(content)
    except json.JSONDecodeError as e:
        raise _RowProblem(f"function_call turn is not valid JSON: {e}") from None
    calls = calls if isinstance(calls, list) else [calls]
    for call in calls:
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and "arguments" in call):
            raise _RowProblem('function_call turn must be {"name": ..., "arguments": ...} or a list of them')
    return calls


def _required_str(data: dict[str, Any], column: str | None, allow_empty: bool = True) -> str:
    value = data.get(column) if column else None
    if value is None:
        raise _RowProblem(f"missing column '{column}'")
    if not isinstance(value, str):
        raise _RowProblem(f"column '{column}' must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise _RowProblem(f"column '{column}' is empty")
    return value


def _optional_str(data: dict[str, Any], column: str | None) -> str | None:
    if not column or data.get(column) is None:
        return None
    return _required_str(data, column) or None


def _convert_alpaca(cols: Columns, data: dict[str, Any]) -> ChatExample:
    response = _required_str(data, cols.response, allow_empty=False)
    messages = (*_alpaca_prompt(cols, data), Message("assistant", response))
    return ChatExample(messages=messages, system=_optional_str(data, cols.system))


def _alpaca_prompt(cols: Columns, data: dict[str, Any]) -> tuple[Message, ...]:
    """The history's turns and the row's prompt (its prompt and query columns, joined)."""
    parts = [_optional_str(data, c) for c in (cols.prompt, cols.query)]
    prompt = "\n".join(p for p in parts if p)
    if not prompt:
        raise _RowProblem(f"empty prompt: columns '{cols.prompt}' and '{cols.query}' are missing or empty")
    return (*_alpaca_history(cols, data), Message("user", prompt))


def _alpaca_history(cols: Columns, data: dict[str, Any]) -> list[Message]:
    history = data.get(cols.history) if cols.history else None
    if not history:
        return []
    if not isinstance(history, list):
        raise _RowProblem(f"column '{cols.history}' must be a list of [prompt, response] pairs")
    messages = []
    for pair in history:
        if not (isinstance(pair, list | tuple) and len(pair) == 2 and all(isinstance(s, str) for s in pair)):
            raise _RowProblem(f"column '{cols.history}' must be a list of [prompt, response] string pairs")
        messages += [Message("user", pair[0]), Message("assistant", pair[1])]
    return messages


def _convert_sharegpt(cols: Columns, tags: Tags, data: dict[str, Any]) -> ChatExample:
    turns = data.get(cols.messages)
    if not isinstance(turns, list) or not turns:
        raise _RowProblem(f"column '{cols.messages}' must be a non-empty list of turns")
    system, turns = _leading_system(tags, turns, _optional_str(data, cols.system))
    if not turns:
        raise _RowProblem("conversation has a system prompt but no turns")
    messages = tuple(_sharegpt_message(turn, tags, i) for i, turn in enumerate(turns))
    if messages[-1].role not in RESPONSE_ROLES:
        raise _RowProblem(f"conversation ends on a '{messages[-1].role}' turn; it must end on an assistant turn")
    return ChatExample(messages=messages, system=system, tools=_tools(data, cols.tools))


def _leading_system(tags: Tags, turns: list[Any], system: str | None) -> tuple[str | None, list[Any]]:
    """A first turn with the system role is the system prompt (it overrides the system column)."""
    first = turns[0]
    if tags.system_tag and isinstance(first, dict) and first.get(tags.role_tag) == tags.system_tag:
        return _turn_content(first, tags, 0), turns[1:]
    return system, turns


def _sharegpt_message(turn: Any, tags: Tags, index: int) -> Message:
    if not isinstance(turn, dict):
        raise _RowProblem(f"turn {index} must be an object, got {type(turn).__name__}")
    role_of: dict[str | None, Role] = {
        tags.user_tag: "user", tags.observation_tag: "observation",
        tags.assistant_tag: "assistant", tags.function_tag: "function_call",
    }
    raw_role = turn.get(tags.role_tag)
    role = role_of.get(raw_role) if raw_role is not None else None
    if role is None:
        raise _RowProblem(f"turn {index}: unknown role {raw_role!r} (key '{tags.role_tag}')")
    expected = PROMPT_ROLES if index % 2 == 0 else RESPONSE_ROLES
    if role not in expected:
        raise _RowProblem(f"turn {index}: role '{raw_role}' out of order (expected one of {list(expected)})")
    content = _turn_content(turn, tags, index)
    if role == "function_call":
        parse_function_call(content)
    return Message(role, content)


def _turn_content(turn: dict[str, Any], tags: Tags, index: int) -> str:
    content = turn.get(tags.content_tag)
    if not isinstance(content, str):
        kind = "missing" if content is None else type(content).__name__
        raise _RowProblem(f"turn {index}: content '{tags.content_tag}' must be a string, got {kind}")
    return content


def _tools(data: dict[str, Any], column: str | None) -> tuple[dict[str, Any], ...] | None:
    value = data.get(column) if column else None
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise _RowProblem(f"column '{column}' is not valid JSON: {e}") from None
    if value is None:
        return None
    value = [value] if isinstance(value, dict) else value
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise _RowProblem(f"column '{column}' must be a JSON list of tool schemas")
    return tuple(value) or None
