"""Outputs are checked before any model or data work, each failure one line naming the key; a run claims its
name only as its first step is about to run, and gives it back when it fails before that step is done."""

import socket

import pytest

from jobs.train import main
from mt_ray.config.run import load_run_config
from mt_ray.training.callbacks import Callback
from mt_ray.training.launch import run


def error_line(capsys, *overrides: str) -> str:
    code = main(["training.steps=1", "engine.device=cpu", *overrides])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    return err


def test_unwritable_storage_and_stores_are_one_line_each(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert error_line(capsys, f"training.storage={tmp_path}/file/runs").startswith(
        f"error: training.storage: cannot write to {tmp_path}/file/runs (Not a directory); point training.storage")
    storage = f"training.storage={tmp_path}/runs"
    assert error_line(capsys, storage, f"tracking.tracking_uri=sqlite:///{tmp_path}/file/mlflow.db").startswith(
        f"error: tracking.tracking_uri: the MLflow store sqlite:///{tmp_path}/file/mlflow.db cannot be written")
    with socket.socket() as s:  # a port nothing listens on: refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert error_line(capsys, storage, f"tracking.tracking_uri=http://127.0.0.1:{port}").startswith(
        f"error: tracking.tracking_uri: cannot reach the MLflow server http://127.0.0.1:{port} (no retries")
    assert not (tmp_path / "runs" / "mlflow.db").exists() and not list((tmp_path / "runs").glob("*/"))


class FailBeforeTheFirstStep(Callback):
    def on_train_start(self, trainer):
        raise RuntimeError("broken before step 1")


def test_a_run_that_fails_before_its_first_step_leaves_its_name_free(tmp_path, capsys):
    common = [f"training.storage={tmp_path}", "training.run_name=r1", "engine.device=cpu", "tracking.enabled=false",
              "training.steps=1"]
    assert main([*common, "data.datasets=demo_alpacaa"]) == 2  # a typo: refused before anything is written
    assert not (tmp_path / "r1").exists()
    with pytest.raises(RuntimeError, match="broken before step 1"):
        run(load_run_config(None, [*common, "optimizer.lr=0.01"]), [FailBeforeTheFirstStep()])
    assert not (tmp_path / "r1").exists()  # claimed at the first step, given back when it failed
    assert run(load_run_config(None, common))["steps"] == 1  # the corrected config takes the name
    assert (tmp_path / "r1" / "run.json").is_file()


def test_mlflow_file_stores_the_readme_names_track_the_run(tmp_path, monkeypatch, capsys):
    """`file:mlruns` and a bare path are MLflow 3.17's file store, which it opens only under its own opt-out."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "unset")  # recorded, so the run's own setting is undone after
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    monkeypatch.chdir(tmp_path)
    common = [f"training.storage={tmp_path}/runs", "engine.device=cpu", "training.steps=1",
              "tracking.system_metrics=false"]
    for uri, folder in (("file:mlruns", tmp_path / "mlruns"), (f"{tmp_path}/bare", tmp_path / "bare")):
        assert main([*common, f"tracking.tracking_uri={uri}", f"training.run_name=r-{folder.name}"]) == 0
        runs = MlflowClient(tracking_uri=str(folder)).search_runs(
            [MlflowClient(tracking_uri=str(folder)).get_experiment_by_name("mt-ray").experiment_id])
        assert [(r.info.run_name, r.info.status) for r in runs] == [(f"r-{folder.name}", "FINISHED")]
    capsys.readouterr()
    (tmp_path / "file").write_text("")
    assert error_line(capsys, f"tracking.tracking_uri=file://{tmp_path}/file/mlruns").startswith(
        f"error: tracking.tracking_uri: the MLflow store file://{tmp_path}/file/mlruns cannot be written (")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "false")  # the user's own choice is kept, and named
    assert error_line(capsys, "tracking.tracking_uri=file:mlruns").startswith(
        f"error: tracking.tracking_uri: file://{tmp_path}/mlruns is MLflow's file store, which "
        "MLFLOW_ALLOW_FILE_STORE=false turns off; unset MLFLOW_ALLOW_FILE_STORE")
