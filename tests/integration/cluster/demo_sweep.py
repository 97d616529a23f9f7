"""The sweep the integration tests run: jobs/configs/demo.yaml made small, over jobs/spaces/demo.yaml; and callbacks
that force a trial's outcome (they travel to the trials' processes, so they live in a module, not a test)."""

import time

from mt_ray.training.callbacks import Callback
from tests.conftest import ROOT

STEPS = 6
# Short rows, 6 steps, an eval every 2 steps on 16 held-out rows, a checkpoint every 2 steps.
DEMO_OVERRIDES = [f"training.steps={STEPS}", "training.eval_every=2", "data.val_size=16", "data.max_seq_len=64",
                  "training.micro_batch_size=2", "training.grad_accum_steps=1", "training.export=false",
                  "engine.device=cpu", "checkpoint.every_steps=2"]
DEMO = str(ROOT / "jobs/configs/demo.yaml")
SPACE = str(ROOT / "jobs/spaces/demo.yaml")


class FailAtFirstEval(Callback):
    """Fails the trial whose `optimizer.lr` is `lr` at its first evaluation, before it reports: a trial that errors."""

    def __init__(self, lr: float):
        self.lr = lr

    def on_evaluate(self, trainer, step: int, metrics: dict) -> None:
        if trainer.cfg.optimizer.lr == self.lr:
            raise RuntimeError(f"forced failure of the trial with lr {self.lr}")


class SlowEnd(Callback):
    """Takes `seconds` to end a run the scheduler stopped, between the stop and the run's summary: longer than Tune
    takes to end a stopped trial's process unless the trial's stop waits for its run."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_step_end(self, trainer, step: int) -> None:
        if trainer.stop_reason is not None:
            time.sleep(self.seconds)
