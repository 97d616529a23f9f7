"""Every infra check is shown able to fail: a deliberately broken copy must be named."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any


def assert_rejects(doc: Any, mutate: Callable[[Any], Any], expected: str, check: Callable[[Any], list[str]]) -> None:
    broken = copy.deepcopy(doc)
    mutate(broken)
    problems = check(broken)
    assert any(expected in p for p in problems), problems
