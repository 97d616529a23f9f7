"""A Ray Tune sweep of short engine runs picks the best trial, and logs each trial as an MLflow child run."""

import json
from pathlib import Path

import pytest

pytest.importorskip("ray")

from jobs.sweep import run_sweep  # noqa: E402
from mt_ray.tracking import TrackingConfig  # noqa: E402

STEPS = 6


@pytest.fixture(scope="module")
def sweep(local_ray, tmp_path_factory):
    """One 4-trial sweep tracked into a local SQLite store; returns (result, store URI)."""
    tmp = tmp_path_factory.mktemp("sweep")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    tracking = TrackingConfig(tracking_uri=uri, experiment="sweep-test")
    best = run_sweep(num_samples=4, steps=STEPS, storage_path=str(tmp / "tune"), tracking=tracking,
                     engine={"device": "cpu", "compute_dtype": "fp32"})
    return best, uri


def test_four_trial_sweep_picks_the_lowest_loss(sweep):
    best, _ = sweep
    assert best["trials"] == 4 and best["errors"] == 0
    assert set(best["config"]) == {"lr", "warmup", "batch"}
    assert best["loss"] == min(best["last_losses"])  # the best is the lowest last loss, stopped trials included


def test_trials_are_child_runs_with_loss_history_and_the_best_is_on_the_parent(sweep, tmp_path):
    from mlflow import MlflowClient

    best, uri = sweep
    client = MlflowClient(tracking_uri=uri)
    parent = client.get_run(best["run_id"])
    assert parent.info.status == "FINISHED" and parent.data.params["sweep.num_samples"] == "4"
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{best['run_id']}'")
    assert len(children) == 4
    last_losses = {}
    for child in children:
        assert child.info.status == "FINISHED"
        assert set(child.data.params) == {"lr", "warmup", "batch"}
        history = client.get_metric_history(child.info.run_id, "loss")
        steps = [m.step for m in sorted(history, key=lambda m: m.step)]
        assert steps == list(range(1, len(steps) + 1)) and 1 <= len(steps) <= STEPS  # ASHA may stop it early
        last_losses[child.info.run_id] = max(history, key=lambda m: m.step).value
    assert sorted(last_losses.values()) == pytest.approx(sorted(best["last_losses"]))

    assert last_losses[best["best_run_id"]] == pytest.approx(best["loss"])
    assert parent.data.metrics["summary.best_loss"] == pytest.approx(best["loss"])
    summary_path = client.download_artifacts(best["run_id"], "summary.json", str(tmp_path))
    summary = json.loads(Path(summary_path).read_text())
    assert summary["best_run_id"] == best["best_run_id"] and summary["best_config"] == best["config"]
