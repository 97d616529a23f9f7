"""Ray job / CLI entry point of a sweep: `python -m jobs.sweep --config run.yaml --space space.yaml [key=value ...]`.

Each trial is an ordinary run of the config (any config `mt-ray train` accepts, with the
overrides) with the space's sampled keys set; trials are judged on their held-out eval loss and
ASHA stops the worse ones. Under `ray job submit` it joins the cluster (RAY_ADDRESS); otherwise
Ray starts in-process. `--resume` continues an interrupted sweep of the same `--name`.
"""

from __future__ import annotations

import argparse
import sys

from mt_ray.cli.sweep_command import add_sweep_arguments, report, sweep
from mt_ray.errors import MtRayError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sweep_arguments(parser)
    args = parser.parse_args(argv)
    try:
        print(report(sweep(args)))
    except MtRayError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
