"""Ray Tune trials as MLflow child runs of one sweep run, logged from the Tune driver.

A Tune callback runs in the driver process, so the trials report to Tune as usual and need
neither mlflow nor the store's address, and a single process writes to the store (a local
SQLite file is safe). Imports Ray Tune: use it where Ray is installed (the `cluster` extra).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ray.tune import Callback

from mt_ray.tracking.mlflow_tracker import MlflowTracker, RunStatus


class TrialRunsCallback(Callback):
    """One child run of `parent` per trial: its sampled config as params, `metrics` at each report.

    Each reported result is logged at its `step_key` value; a trial the scheduler stops early
    ends FINISHED, one that raised ends FAILED. `run_ids` maps trial ids to child run ids.
    """

    def __init__(self, parent: MlflowTracker, metrics: Sequence[str] = ("loss",), step_key: str = "step"):
        self.parent = parent
        self.metrics = tuple(metrics)
        self.step_key = step_key
        self.runs: dict[str, MlflowTracker] = {}
        self.run_ids: dict[str, str | None] = {}

    def on_trial_start(self, iteration: int, trials: list, trial, **info: Any) -> None:
        if trial.trial_id in self.runs:
            return  # a trial resumed after a pause keeps its run
        child = self.parent.start_child(str(trial), trial.config, tags={"ray.trial_id": trial.trial_id})
        self.runs[trial.trial_id] = child
        self.run_ids[trial.trial_id] = child.run_id

    def on_trial_result(self, iteration: int, trials: list, trial, result: dict, **info: Any) -> None:
        values = {k: result[k] for k in self.metrics if k in result}
        self.runs[trial.trial_id].log_metrics(int(result[self.step_key]), values)

    def on_trial_complete(self, iteration: int, trials: list, trial, **info: Any) -> None:
        self._close(trial.trial_id, "FINISHED")

    def on_trial_error(self, iteration: int, trials: list, trial, **info: Any) -> None:
        self._close(trial.trial_id, "FAILED")

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        for trial_id in self.runs:
            self._close(trial_id, "KILLED")  # only runs still open: closing twice does nothing

    def _close(self, trial_id: str, status: RunStatus) -> None:
        run = self.runs.get(trial_id)
        if run is not None:
            run.close(status)
