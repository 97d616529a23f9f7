"""The programs a shell line runs, so a start command's flags can be checked against the real CLI.

Enough shell for the one-liners in cluster definitions: `;`, `&&`, `||`, `&`, `|` and parentheses
separate commands, redirections and their targets are dropped, and so is `nohup`; leading
`VAR=value` assignments are kept apart as the command's environment. Quoting follows POSIX `shlex`.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.DOTALL)
_PREFIXES = {"nohup", "exec"}


@dataclass
class SimpleCommand:
    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)


def simple_commands(line: str) -> list[SimpleCommand]:
    """`"ulimit -n 9; X=1 ray start"` -> `[({}, [ulimit, -n, 9]), ({X: 1}, [ray, start])]`."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = list(lexer)
    commands, current, i = [], SimpleCommand(), 0
    while i < len(tokens):
        token = tokens[i]
        if _is_redirect(token):
            i += 2  # the operator and its target
            continue
        if token.isdigit() and i + 1 < len(tokens) and _is_redirect(tokens[i + 1]):
            i += 1  # the file descriptor of `2>&1`
            continue
        assignment = _ASSIGNMENT.match(token)
        if _is_operator(token):
            commands.append(current)
            current = SimpleCommand()
        elif not current.argv and assignment:
            current.env[assignment.group(1)] = assignment.group(2)
        elif current.argv or token not in _PREFIXES:
            current.argv.append(token)
        i += 1
    commands.append(current)
    return [c for c in commands if c.argv]


def find_command(line: str | list[str], *program: str) -> SimpleCommand | None:
    """The first command in `line` that runs `program` (e.g. `"ray", "start"`), else None.

    `line` is a shell string or an exec-form list (compose `command:`, Dockerfile JSON form).
    """
    commands = [SimpleCommand(argv=list(line))] if isinstance(line, list) else simple_commands(line)
    return next((c for c in commands if tuple(c.argv[: len(program)]) == program), None)


def program_args(line: str | list[str], *program: str) -> list[str] | None:
    """The arguments after `program` in the first command that runs it, else None."""
    found = find_command(line, *program)
    return None if found is None else found.argv[len(program):]


def _is_operator(token: str) -> bool:
    return bool(token) and all(c in "();<>|&" for c in token)


def _is_redirect(token: str) -> bool:
    return _is_operator(token) and ("<" in token or ">" in token)
