"""`jobs.train` that SIGKILLs itself right after the checkpoint of a chosen step, whatever the machine's speed.

    python -m tests.integration.tracking.kill_after_checkpoint STEP [key=value ...]

The kill enters through `jobs.train.run`'s `extra_callbacks` seam, after every other callback has
seen the checkpoint (the MLflow run has its URI): the process dies as on a lost node, with no
`finally` run and nothing flushed. A run that starts past STEP trains to the end and exits 0.
"""

from __future__ import annotations

import os
import signal
import sys

from mt_ray.config.run import load_run_config
from mt_ray.training import Callback
from mt_ray.training.launch import run


class SigkillAfterCheckpoint(Callback):
    """Kills this process once the checkpoint of `step` is complete (a CPU run starts no other process)."""

    def __init__(self, step: int):
        self.step = step

    def on_checkpoint(self, trainer, uri: str) -> None:
        if trainer.step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> int:
    step, *overrides = argv
    run(load_run_config(None, overrides), extra_callbacks=[SigkillAfterCheckpoint(int(step))])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
