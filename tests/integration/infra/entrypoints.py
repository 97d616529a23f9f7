"""Training commands in the cluster definitions (`python -m jobs.train --config X key=value ...`) resolve.

A command resolves when its module is one of this repository's, its arguments parse with
`jobs.train`'s own parser, its config file exists and the config with the command's overrides
loads with `load_run_config`: a typo'd key or a bad value fails here, not on a GPU node an hour
after submission.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from jobs.train import build_parser
from mt_ray.config.run import load_run_config
from mt_ray.errors import ConfigError
from tests.integration.infra.compose import ROOT

TRAIN_MODULE = "jobs.train"
_DOCUMENTED = re.compile(r"python -m jobs\.train\b[^\"`\n]*")


@dataclass
class ModuleCommand:
    module: str
    args: list[str]

    @classmethod
    def parse(cls, command: str | list[str]) -> ModuleCommand:
        """`python -m MODULE ARGS...`; anything else raises ValueError."""
        argv = shlex.split(command) if isinstance(command, str) else list(command)
        if len(argv) < 3 or not Path(argv[0]).name.startswith("python") or argv[1] != "-m":
            raise ValueError(f"not a `python -m MODULE` command: {command!r}")
        return cls(argv[2], argv[3:])

    def train_args(self) -> argparse.Namespace:
        """The arguments as `jobs.train` reads them; a bad command line raises ValueError."""
        parser = build_parser()
        parser.exit_on_error = False
        try:
            with contextlib.redirect_stderr(io.StringIO()) as err:
                return parser.parse_args(self.args)
        except (argparse.ArgumentError, SystemExit) as e:
            raise ValueError(f"{self.module}: {err.getvalue().strip() or e}") from None


def entrypoint_problems(command: str | list[str], cwd: Path = ROOT) -> list[str]:
    """Why `command`, run from `cwd` (the repository, or the image's working directory), would not start."""
    try:
        cmd = ModuleCommand.parse(command)
        if not _in_repository(cmd.module):
            return [f"module {cmd.module!r} is not part of this repository"]
        if cmd.module != TRAIN_MODULE:
            return []
        args = cmd.train_args()
    except ValueError as e:
        return [str(e)]
    if args.config is not None and not (cwd / args.config).is_file():
        return [f"config {args.config!r} does not exist under {cwd}"]
    try:
        load_run_config(cwd / args.config if args.config else None, args.overrides)
    except ConfigError as e:
        return [f"{args.config or 'the default config'}: {e}"]
    return []


def _in_repository(module: str) -> bool:
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return False
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.origin is not None and Path(spec.origin).resolve().is_relative_to(ROOT)


def documented_commands(text: str) -> list[str]:
    """`python -m jobs.train ...` written in prose or comments (`#` stripped, `\\` continuations joined),
    up to a closing quote or backtick; ones with a `...` placeholder are left out."""
    lines = [re.sub(r"^\s*#\s?", "", line) for line in text.splitlines()]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [c for c in (m.group(0).strip() for m in _DOCUMENTED.finditer(joined)) if "..." not in c]
