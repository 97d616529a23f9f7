"""Ray job / CLI entry point: `python -m jobs.train --config jobs/configs/demo.yaml [key=value ...]`.

With no arguments it trains the built-in tiny model on the demo data (CPU when no GPU).
`cluster.num_workers=N` (N > 1) runs the same loop on N Ray engine workers around a coordinator:
it joins `cluster.address` or RAY_ADDRESS (as under `ray job submit`), else starts Ray in-process.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from mt_ray.cli.startup import run_quietly
from mt_ray.errors import MtRayError


def build_parser() -> argparse.ArgumentParser:
    """The command line; the infra tests parse cluster entrypoints with it too."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default=None, help="YAML run config; default: the embedded demo")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = shlex.join(["python", "-m", "jobs.train", *(["--config", args.config] if args.config else []),
                          *args.overrides])
    return run_quietly("jobs.train", lambda: _train(args, command))


def _train(args: argparse.Namespace, command: str) -> int:
    from mt_ray.config.run import load_run_config  # seconds of torch and transformers: after the first line
    from mt_ray.training.launch import run_from_command_line

    try:
        return run_from_command_line(load_run_config(args.config, args.overrides), command)
    except MtRayError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
