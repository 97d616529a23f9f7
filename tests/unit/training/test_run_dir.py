"""The run directory: where it is, what it records, what it refuses (no engine is built here)."""

import json

import pytest
import yaml

from mt_ray.config.run import load_run_config
from mt_ray.errors import ConfigError
from mt_ray.training.run_dir import RAY_JOB_ENV, RunDir


def test_a_run_lives_in_its_folder_under_the_storage_root(tmp_path):
    cfg = load_run_config(None, [f"training.storage={tmp_path}", "training.run_name=r1"])
    run = RunDir(cfg)
    assert run.uri == f"{tmp_path}/r1" and run.checkpoint_config.uri == f"{tmp_path}/r1/checkpoints"
    assert run.checkpoint_config.every_steps == cfg.checkpoint.every_steps
    run.claim(cfg)
    recorded = json.loads((tmp_path / "r1" / "run.json").read_text())
    assert recorded["name"] == "r1" and recorded["fingerprint"] == run.identity.fingerprint
    assert yaml.safe_load((tmp_path / "r1" / "config.yaml").read_text())["training"]["run_name"] == "r1"
    assert run.read_summary() is None
    run.write_summary({"steps": 3})
    assert run.read_summary() == {"steps": 3}


def test_another_config_under_the_same_name_is_refused_with_the_changed_keys(tmp_path):
    common = [f"training.storage={tmp_path}", "training.run_name=r1"]
    RunDir(cfg := load_run_config(None, common)).claim(cfg)
    RunDir(cfg := load_run_config(None, [*common, "engine.device=cpu"])).claim(cfg)  # how, not what: allowed
    changed = load_run_config(None, [*common, "optimizer.lr=0.01", "data.max_seq_len=64"])
    with pytest.raises(ConfigError) as e:
        RunDir(changed).claim(changed)
    assert str(e.value).splitlines()[1:3] == ["  data.max_seq_len: 256 -> 64", "  optimizer.lr: 0.001 -> 0.01"]
    assert "another training.run_name (in a LLaMA-Factory file, another output_dir)" in str(e.value)


def test_relative_storage_resolves_here_but_is_refused_under_a_ray_job(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(RAY_JOB_ENV, raising=False)
    assert RunDir(load_run_config()).root == str(tmp_path / "runs")
    monkeypatch.setenv(RAY_JOB_ENV, "{}")
    with pytest.raises(ConfigError, match=r"training\.storage: 'runs' is a relative path, and this is a Ray job"):
        RunDir(load_run_config())
    assert RunDir(load_run_config(None, [f"training.storage={tmp_path}/abs"])).root == f"{tmp_path}/abs"


def test_the_default_mlflow_store_is_in_the_storage_root(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv(RAY_JOB_ENV, raising=False)
    run = RunDir(load_run_config(None, [f"training.storage={tmp_path}", "training.run_name=r1"]))
    assert run.tracking_config.run_name == "r1"
    assert run.tracking_config.tracking_uri == f"sqlite:///{tmp_path}/mlflow.db"
    assert run.tracking_config.artifact_location == f"{tmp_path}/mlartifacts"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")  # the cluster's server wins
    assert RunDir(load_run_config(None, [f"training.storage={tmp_path}"])).tracking_config.tracking_uri is None
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.setenv(RAY_JOB_ENV, "{}")
    with pytest.raises(ConfigError, match=r"tracking\.tracking_uri: this Ray job stores the run on S3"):
        RunDir(load_run_config(None, ["training.storage=s3://bucket/runs"]))


@pytest.mark.parametrize(("given", "resolved"), [
    ("sqlite:///sweep.db", "sqlite:///{cwd}/sweep.db"), ("sqlite:///{cwd}/abs.db", "sqlite:///{cwd}/abs.db"),
    ("file:store", "file://{cwd}/store"), ("file:///{cwd}/store", "file://{cwd}/store"), ("./store", "{cwd}/store"),
    ("http://mlflow:5000", "http://mlflow:5000"), ("databricks", "databricks")])
def test_a_relative_tracking_uri_resolves_where_the_command_was_launched(tmp_path, monkeypatch, given, resolved):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(RAY_JOB_ENV, raising=False)
    cwd = str(tmp_path.resolve())
    tracking = RunDir(load_run_config(None, [f"training.storage={tmp_path}",
                                             f"tracking.tracking_uri={given.format(cwd=cwd)}"])).tracking_config
    assert tracking.tracking_uri == resolved.format(cwd=cwd)
    # A local SQLite store keeps its artifacts beside the database, never in a ./mlruns of the working directory.
    beside = f"{cwd}/mlartifacts" if given.startswith("sqlite:///") else None
    assert tracking.artifact_location == beside


def test_relative_tracking_paths_are_refused_under_a_ray_job_with_the_absolute_form(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(RAY_JOB_ENV, "{}")
    storage = f"training.storage={tmp_path}"
    with pytest.raises(ConfigError, match=r"tracking\.tracking_uri: 'sweep\.db' is a relative path, and this is a Ray "
                                          r"job.*e\.g\. tracking\.tracking_uri=sqlite:///\$PWD/sweep\.db"):
        RunDir(load_run_config(None, [storage, "tracking.tracking_uri=sqlite:///sweep.db"]))
    with pytest.raises(ConfigError, match=r"tracking\.artifact_location: 'arts' is a relative path.*"
                                          r"tracking\.artifact_location=\$PWD/arts"):
        RunDir(load_run_config(None, [storage, "tracking.artifact_location=arts"]))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///env.db")
    with pytest.raises(ConfigError, match=r"MLFLOW_TRACKING_URI: 'env\.db' is a relative path"):
        RunDir(load_run_config(None, [storage]))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/env.db")  # absolute: pinned in the config
    assert RunDir(load_run_config(None, [storage])).tracking_config.tracking_uri == f"sqlite:///{tmp_path}/env.db"


def test_the_run_folders_config_yaml_loads_as_it_is(tmp_path):
    """`mt-ray train --config` and `mt-ray export --config` read it with `load_run_config`: an epoch-based run's
    derived steps and the keys the run sets are not in it, and an earlier version's file (which has them at their
    defaults, and both lengths) loads once the derived steps are taken out."""
    cfg = load_run_config(None, [f"training.storage={tmp_path}", "training.run_name=r1", "training.epochs=2"])
    counted = cfg.model_copy(update={"training": cfg.training.model_copy(update={"steps": 17})})  # as the trainer has it
    RunDir(counted).claim(counted)
    saved = tmp_path / "r1" / "config.yaml"
    again = load_run_config(saved)
    assert again.training.epochs == 2 and "steps" not in again.training.model_fields_set
    assert again.model_dump(exclude={"training": {"steps"}}) == cfg.model_dump(exclude={"training": {"steps"}})
    earlier = yaml.safe_load(saved.read_text())
    earlier["checkpoint"]["uri"], earlier["tracking"]["run_name"] = "runs/checkpoints", None
    saved.write_text(yaml.safe_dump(earlier))
    assert load_run_config(saved).checkpoint == cfg.checkpoint
    with pytest.raises(ConfigError, match=r"checkpoint\.uri: checkpoints go to"):
        load_run_config(None, ["checkpoint.uri=/elsewhere"])
