"""Runs keep to themselves: own folders and checkpoints per config, resume only of the same run, said aloud.

Each run is `python -m jobs.train` in this process (its `main`), in a scratch working directory,
with the default storage (`runs/` there) unless a test says otherwise.
"""

import json

import pytest

import mt_ray.training.launch as launch
from jobs.train import main
from mt_ray.tracking import CheckpointConfig, CheckpointManager
from tests.conftest import StopAt

FAST = ["training.steps=4", "checkpoint.every_steps=2", "data.max_seq_len=64", "engine.device=cpu",
        "tracking.enabled=false", "training.export=false", "training.log_every=1"]


@pytest.fixture(autouse=True)
def scratch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)


def run_folders(tmp_path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*/run.json")}


def checkpoints(tmp_path, name) -> list[tuple[int, str]]:
    manager = CheckpointManager(CheckpointConfig(uri=str(tmp_path / "runs" / name / "checkpoints")))
    return [(c.step, manager.read_meta(c.uri)["run"]["name"]) for c in manager.list()]


def test_two_configs_with_default_settings_are_two_runs_that_share_no_checkpoint(tmp_path):
    assert main(FAST) == 0
    assert main([*FAST, "data.datasets=[demo_alpaca]"]) == 0
    runs = run_folders(tmp_path)
    assert len(runs) == 2
    for name, identity in runs.items():
        assert identity["name"] == name and name.endswith(identity["fingerprint"])
        assert checkpoints(tmp_path, name) == [(2, name), (4, name)]
    assert {r["keys"]["data.datasets"][-1] for r in runs.values()} == {"demo_alpaca", "demo_sharegpt"}


def test_a_rerun_resumes_its_own_run_and_says_so(tmp_path, monkeypatch, capsys):
    build = launch.build_callbacks
    monkeypatch.setattr(launch, "build_callbacks", lambda cfg, run: [*build(cfg, run), StopAt(3)])
    assert main([*FAST, "training.run_name=r"]) == 130  # interrupted (Ctrl-C)
    monkeypatch.setattr(launch, "build_callbacks", build)
    capsys.readouterr()

    assert main([*FAST, "training.run_name=r"]) == 0
    out = capsys.readouterr().out
    assert f"resuming run r from {tmp_path}/runs/r/checkpoints/step-00000002 (step 2 of 4)" in out
    assert "done: 4 steps" in out
    summary = json.loads((tmp_path / "runs" / "r" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["run"] == "r"

    assert main([*FAST, "training.run_name=r"]) == 0  # finished: nothing is trained again
    assert "run r already finished (4 steps)" in capsys.readouterr().out


def test_a_changed_config_under_the_same_name_is_refused_with_the_diff(tmp_path, capsys):
    assert main([*FAST, "training.run_name=r"]) == 0
    capsys.readouterr()
    assert main([*FAST, "training.run_name=r", "optimizer.lr=0.01", "data.datasets=[demo_alpaca]"]) == 2
    err = capsys.readouterr().err
    assert "error: run 'r' was started with another config" in err and "Traceback" not in err
    assert '  data.datasets: ["demo_alpaca", "demo_sharegpt"] -> ["demo_alpaca"]\n' in err
    assert "  optimizer.lr: 0.001 -> 0.01\n" in err
    assert checkpoints(tmp_path, "r") == [(2, "r"), (4, "r")]  # untouched


def test_resume_never_and_another_models_checkpoint_are_refused_clearly(tmp_path, capsys):
    assert main([*FAST, "training.run_name=r"]) == 0
    capsys.readouterr()
    assert main([*FAST, "training.run_name=r", "training.resume=never"]) == 2
    assert "training.resume: never, but run 'r' already has checkpoints" in capsys.readouterr().err

    other = f"{tmp_path}/runs/r/checkpoints/step-00000002"
    assert main([*FAST, "training.run_name=small", "model.overrides={num_hidden_layers: 1}",
                 f"training.resume={other}"]) == 2
    err = capsys.readouterr().err
    assert f"training.resume: {other} holds run 'r', a different model:" in err
    assert "model.overrides: {} -> (unset)" in err and "model.overrides.num_hidden_layers: (unset) -> 1" in err

    assert main([*FAST, "training.run_name=fork", f"training.resume={other}"]) == 0  # same model: a fork
    assert "resuming run fork from" in capsys.readouterr().out
    assert checkpoints(tmp_path, "fork") == [(4, "fork")]
