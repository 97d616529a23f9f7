"""A sweep's MLflow run, kept by the Tune driver; its trials are child runs that each trial logs itself.

The trials are ordinary runs whose tracking config names the sweep's run as parent and tags them
with their trial id (`mt_ray.sweep.trial_id`), so the driver finds a trial's run by that tag. It
closes a trial's run when Tune ends the trial (a trial restarted by a resumed sweep leaves an open run
behind): FINISHED, tagged with its stop reason, where the scheduler stopped it; FAILED, tagged with its error
(`mt_ray.error`), where it errored. A trial's own process closes its run as well, last (a stopped trial
finishes its run before Tune ends its actor: `sweep.trial_trainable`), so a run that failed while finishing
stays FAILED; the sweep counts it among its errors (`failed_trials`), so the sweep and its runs agree.
Imports Ray Tune: use it where Ray is installed (the `cluster` extra).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import yaml
from ray.tune import Callback

from mt_ray.tracking.mlflow_tracker import ERROR_TAG, MlflowTracker, RunStatus, TrackingConfig, error_line

if TYPE_CHECKING:
    from mlflow import MlflowClient

BEST_CONFIG_ARTIFACT = "best_config.yaml"
TRIAL_ID_TAG = "mt_ray.sweep.trial_id"
STOPPED_TAG = "mt_ray.sweep.stopped_early"  # on a trial's run the scheduler stopped: why


def open_sweep_run(tracker: MlflowTracker, record: dict[str, Any] | None, params: dict[str, Any],
                   storage_uri: str) -> None:
    """Start the sweep's run, or continue the one in the record of a resumed sweep (when the store still has it)."""
    tracker.start(params, tags={"mt_ray.sweep.storage": storage_uri},
                  resume_run_id=record.get("run_id") if record is not None else None)


def trial_runs(client: MlflowClient, parent_run_id: str, trial_id: str, status: str | None = None) -> list:
    """Child runs of the sweep's run tagged with `trial_id` (newest first), optionally only those in `status`."""
    experiment = client.get_run(parent_run_id).info.experiment_id
    where = f"tags.mlflow.parentRunId = '{parent_run_id}' and tags.`{TRIAL_ID_TAG}` = '{trial_id}'"
    if status is not None:
        where += f" and attributes.status = '{status}'"
    return client.search_runs([experiment], where, order_by=["attributes.start_time DESC"])


def failed_trials(tracker: MlflowTracker) -> dict[str, str]:
    """The sweep's trials whose run ended FAILED, each with its error (its `mt_ray.error` tag)."""
    if not tracker.active:
        return {}
    experiment = tracker.client.get_run(tracker.run_id).info.experiment_id
    runs = tracker.client.search_runs([experiment], f"tags.mlflow.parentRunId = '{tracker.run_id}' and "
                                                    "attributes.status = 'FAILED'")
    return {r.data.tags.get(TRIAL_ID_TAG, r.info.run_id): r.data.tags.get(ERROR_TAG, "its run failed")
            for r in runs}


def best_trial_run(tracker: MlflowTracker, trial_id: str, best_config: dict[str, Any]) -> dict[str, str]:
    """Put the best trial on the sweep's run: its config as an artifact, its run id and logged model (if any) as tags."""
    if not tracker.active:
        return {}
    tracker.log_text(yaml.safe_dump(best_config, sort_keys=False), BEST_CONFIG_ARTIFACT)
    links: dict[str, str] = {}
    runs = trial_runs(tracker.client, tracker.run_id, trial_id)
    if runs:
        links["best_run_id"] = run_id = runs[0].info.run_id
        models = tracker.client.search_logged_models([runs[0].info.experiment_id], f"source_run_id = '{run_id}'",
                                                     max_results=1)
        if models:
            links["best_model_uri"] = f"models:/{models[0].model_id}"
    for key, value in links.items():
        tracker.client.set_tag(tracker.run_id, key, value)
    return links


class TrialRunsCallback(Callback):
    """Closes trials' child runs as Tune ends them; tags those ASHA stopped with `mt_ray.sweep.stopped_early`.

    Holds only the tracking config and ids (Tune pickles it with the sweep's state for `--resume`).
    """

    def __init__(self, tracking: TrackingConfig, parent_run_id: str | None, steps: int):
        self.tracking = tracking
        self.parent_run_id = parent_run_id
        self.steps = steps

    def on_trial_start(self, iteration: int, trials: list, trial, **info: Any) -> None:
        self._close_open_runs(trial.trial_id, "KILLED")  # left behind by a sweep killed while this trial ran

    def on_trial_complete(self, iteration: int, trials: list, trial, **info: Any) -> None:
        step = trial.last_result.get("step", self.steps)
        if self.parent_run_id is not None and step < self.steps:
            for run in trial_runs(self._client(), self.parent_run_id, trial.trial_id)[:1]:
                self._client().set_tag(run.info.run_id, STOPPED_TAG, f"stopped by the scheduler at step {step}")
        self._close_open_runs(trial.trial_id, "FINISHED")

    def on_trial_error(self, iteration: int, trials: list, trial, **info: Any) -> None:
        error = trial.get_error()
        self._close_open_runs(trial.trial_id, "FAILED", error_line(error) if error is not None else None)

    def _close_open_runs(self, trial_id: str, status: RunStatus, error: str | None = None) -> None:
        if self.parent_run_id is None:
            return
        for run in trial_runs(self._client(), self.parent_run_id, trial_id, status="RUNNING"):
            if error is not None and ERROR_TAG not in run.data.tags:
                self._client().set_tag(run.info.run_id, ERROR_TAG, error)
            self._client().set_terminated(run.info.run_id, status)

    def _client(self) -> MlflowClient:
        return MlflowTracker(self.tracking).client
