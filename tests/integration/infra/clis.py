"""Parse a command line with the real CLI of the pinned version (`ray start`, `mlflow server`), without running it.

An unknown flag or a value of the wrong type raises `click.UsageError`, exactly as the program
would at start-up; the parsed values (ports, addresses) feed the wiring checks.
"""

from __future__ import annotations

from typing import Any

import click


def cli_params(command: click.Command, args: list[str]) -> dict[str, Any]:
    with command.make_context(command.name or "cli", list(args)) as ctx:
        return dict(ctx.params)


def ray_start_params(args: list[str]) -> dict[str, Any]:
    from ray.scripts.scripts import start

    return cli_params(start, args)


def mlflow_server_params(args: list[str]) -> dict[str, Any]:
    from mlflow.cli import server

    return cli_params(server, args)
