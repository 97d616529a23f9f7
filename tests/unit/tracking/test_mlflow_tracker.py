"""MlflowTracker without a server: params redaction, tags, the off switch, and the default local store."""

from __future__ import annotations

import json
import logging
import subprocess
import time

import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from mt_ray.tracking.mlflow_tracker import (
    MlflowTracker,
    TrackingConfig,
    flatten_params,
    git_commit,
    redact,
    run_tags,
)

RUN_CONFIG = {
    "model": {"name": "Qwen/Qwen2.5-0.5B", "pad_token_id": 0, "max_tokens": 2048},
    "optimizer": {"lr": 1e-4, "betas": [0.9, 0.95]},
    "checkpoint": {"uri": "s3://bucket/run", "endpoint_url": "http://minio:9000", "aws_secret_access_key": "sk",
                   "keep_last": 3},
    "hf_token": "hf_abc", "tracking": {"tracking_uri": "http://mlflow:5000"}, "notes": "x" * 7000,
    "data_path": "file:///data/train.jsonl",
}


def test_params_are_flat_and_never_hold_credentials_or_uris():
    params = flatten_params(RUN_CONFIG)
    assert params["model.name"] == "Qwen/Qwen2.5-0.5B"
    assert params["model.pad_token_id"] == "0" and params["model.max_tokens"] == "2048"
    assert params["optimizer.lr"] == "0.0001" and params["optimizer.betas"] == "[0.9, 0.95]"
    assert params["checkpoint.keep_last"] == "3" and len(params["notes"]) == 6000
    for dropped in ("checkpoint.uri", "checkpoint.endpoint_url", "checkpoint.aws_secret_access_key", "hf_token",
                    "tracking.tracking_uri", "data_path"):
        assert dropped not in params
    text = json.dumps(params)
    assert "sk" not in text.split('"') and "hf_abc" not in text and "://" not in text


def test_redacted_config_keeps_shape():
    red = redact(RUN_CONFIG)
    assert red["checkpoint"] == {"uri": "<redacted>", "endpoint_url": "<redacted>",
                                 "aws_secret_access_key": "<redacted>", "keep_last": 3}
    assert red["model"] == RUN_CONFIG["model"] and red["hf_token"] == "<redacted>"


def test_tags_name_model_dataset_hardware_and_commit(tmp_path, monkeypatch):
    tags = run_tags("tiny-llama", "demo_alpaca")
    assert tags["mt_ray.model"] == "tiny-llama" and tags["mt_ray.dataset"] == "demo_alpaca"
    assert tags["mt_ray.hardware"].startswith("cpu") and float(tags["mt_ray.host_ram_gib"]) > 0
    monkeypatch.chdir(tmp_path)
    assert git_commit() is None and "mt_ray.git_commit" not in run_tags(None, None)
    subprocess.run(["git", "init", "-q"], check=True)
    (tmp_path / "f").write_text("1")
    subprocess.run(["git", "add", "f"], check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c"], check=True)
    sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert git_commit() == (sha, False)
    (tmp_path / "f").write_text("2")
    assert run_tags(None, None)["mt_ray.git_commit"] == f"{sha}+dirty"


class ExplodingClient:
    """Every call fails, as an unreachable tracking server would."""

    def __getattr__(self, name):
        raise AssertionError(f"a disabled tracker must not call MLflow ({name})")


def test_disabled_tracker_does_nothing(tmp_path):
    tracker = MlflowTracker(TrackingConfig(enabled=False), client=ExplodingClient())
    assert tracker.start(RUN_CONFIG) is None
    tracker.log_metrics(1, {"loss": 1.0})
    tracker.log_summary({"loss": 1.0})
    tracker.log_loss_plot([1], [1.0])
    tracker.log_checkpoint_uri("x")
    assert tracker.log_hf_model(tmp_path) is None
    with tracker.child_run("trial") as child:
        child.log_metrics(1, {"loss": 1.0})
    tracker.close()
    assert not TrackingConfig(enabled=False).should_log(10) and TrackingConfig(log_every=5).should_log(10)


class FlakyClient:
    """A real client whose metric and tag writes fail, as during a tracking-server outage."""

    def __init__(self, client: MlflowClient):
        self.client = client

    def __getattr__(self, name):
        return getattr(self.client, name)

    def log_batch(self, run_id, metrics=(), params=()):
        if metrics:
            raise MlflowException("API request failed: connection refused")
        return self.client.log_batch(run_id, params=params)

    def set_tag(self, *args):
        raise MlflowException("API request failed: connection refused")


def test_default_local_store_and_outage_tolerance(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = MlflowTracker(TrackingConfig(run_name="local"))
    run_id = tracker.start({"lr": 0.1}, model="tiny")
    for step in range(3):
        tracker.log_metrics(step, {"loss": 2.0 - step})
    tracker.close()
    assert (tmp_path / "mlflow.db").is_file()  # MLflow 3's default store, in the working directory

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(run_id)
    assert run.data.params == {"lr": "0.1"} and run.info.status == "FINISHED"
    assert [m.value for m in client.get_metric_history(run_id, "loss")] == [2.0, 1.0, 0.0]

    flaky = MlflowTracker(TrackingConfig(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}"),
                          client=FlakyClient(client))
    flaky.start({"lr": 0.1})
    with caplog.at_level(logging.WARNING):
        flaky.log_metrics(5, {"loss": 1.0})
        flaky.log_checkpoint_uri("s3://b/step-00000005")
    flaky.close("KILLED")
    assert "dropped metrics of step 5" in caplog.text and "dropped the checkpoint tag" in caplog.text


def test_child_run_failure_is_recorded(tmp_path):
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")  # a store without a server
    parent = MlflowTracker(TrackingConfig(experiment="sweep"), client=client)
    parent_id = parent.start({"sweep": "lr"})
    with pytest.raises(RuntimeError), parent.child_run("trial-1", {"lr": 1.0}) as child:
        child_id = child.run_id
        raise RuntimeError("diverged")
    parent.close()
    run = client.get_run(child_id)
    assert run.info.status == "FAILED" and run.data.tags["mlflow.parentRunId"] == parent_id
    assert run.info.run_name == "trial-1" and run.data.params == {"lr": "1.0"}



def test_a_run_left_running_is_killed_when_its_name_starts_again_and_a_resume_reopens_its_own(tmp_path):
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    config = TrackingConfig(run_name="r", system_metrics=False)
    died = MlflowTracker(config, client=client).start({"lr": 0.1})  # its process died: never closed
    other = MlflowTracker(config.model_copy(update={"run_name": "other"}), client=client).start({})
    first = MlflowTracker(config, client=client)
    run_id = first.start({"lr": 0.1})
    assert client.get_run(died).info.status == "KILLED" and client.get_run(other).info.status == "RUNNING"
    first.log_metrics(1, {"loss": 2.0})
    first.close("KILLED")

    again = MlflowTracker(config, client=client)  # the run resumed from a checkpoint: the same MLflow run
    assert again.start({"lr": 0.5}, resume_run_id=run_id) == run_id
    assert client.get_run(run_id).info.status == "RUNNING"
    again.log_resume("/runs/r/checkpoints/step-00000001", 1)
    again.log_metrics(2, {"loss": 1.0})
    again.close()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.1"}  # params stay the first start's
    assert run.data.tags["mt_ray.resumed_from"] == "/runs/r/checkpoints/step-00000001 (step 1)"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(1, 2.0), (2, 1.0)]
    assert MlflowTracker(config, client=client).start({}, resume_run_id="no-such-run") not in (None, run_id)
    experiment = client.get_experiment_by_name("mt-ray")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # the model-training view


def test_system_metrics_are_sampled_while_the_run_is_open(tmp_path):
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    tracker = MlflowTracker(TrackingConfig(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                                           system_metrics_interval_s=0.2), client=client)
    run_id = tracker.start({})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "system/cpu_utilization_percentage" not in client.get_run(run_id).data.metrics:
        time.sleep(0.2)
    tracker.close()
    metrics = client.get_run(run_id).data.metrics
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= metrics.keys()
