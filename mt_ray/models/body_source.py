"""Where a body's forward first uses one of its children, read from its source.

A body runs some children before its layers (GPT-2's `wpe`, Gemma 4's per-layer input embeddings) and some
after (the final norm). Which side a child is on decides which unit streams it. A child is used where the
forward names `self.<child>`, or where it calls one of its own methods that does (Gemma 4's
`self.get_per_layer_inputs(...)` runs `self.embed_tokens_per_layer`), at any depth.
"""

from __future__ import annotations

import inspect
import re
from functools import cache


def first_use(cls: type, attr: str) -> int | None:
    """Where `cls.forward`'s source first uses `self.<attr>`, directly or through a method (None: never)."""
    source = _source(cls, "forward") or ""
    uses = [m.start() for m in re.finditer(rf"self\.{re.escape(attr)}\b", source)][:1]
    uses += [c.start() for c in re.finditer(r"self\.(\w+)\s*\(", source) if attr in _reaches(cls, c.group(1))][:1]
    return min(uses, default=None)


def applied_beside(cls: type, attr: str, method: str) -> bool:
    """Whether `cls.forward` uses `self.<attr>` itself while `cls.<method>` never reaches it: Llama 4's forward applies
    its projector to what its `get_image_features` returns, where LLaVA's `get_image_features` applies it."""
    source = _source(cls, "forward") or ""
    return re.search(rf"self\.{re.escape(attr)}\b", source) is not None and attr not in _reaches(cls, method)


def read_apart(cls: type, attr: str, method: str) -> bool:
    """Whether `cls.forward` never names `self.<attr>` itself and `cls.<method>` never reaches it: the Omni thinkers'
    audio tower, read only through their `get_audio_features`, where `get_image_features` reads the vision tower."""
    source = _source(cls, "forward") or ""
    return re.search(rf"self\.{re.escape(attr)}\b", source) is None and attr not in _reaches(cls, method)


def reached_by(cls: type, attr: str, method: str) -> bool:
    """Whether `cls.<method>` uses `self.<attr>`, directly or through the methods it calls."""
    return attr in _reaches(cls, method)


@cache
def _reaches(cls: type, method: str) -> frozenset[str]:
    """Every `self.<name>` that `cls.<method>` names, directly or through the methods it calls."""
    seen: set[str] = set()
    todo, names = [method], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        found = set(re.findall(r"self\.(\w+)\b", _source(cls, name) or ""))
        names |= found
        todo += found
    return frozenset(names)


@cache
def _source(cls: type, method: str) -> str | None:
    """The source of `cls.<method>` where it is a plain function (None for a child module, a builtin, ...)."""
    function = inspect.getattr_static(cls, method, None)
    if not inspect.isfunction(function):
        return None
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return None
