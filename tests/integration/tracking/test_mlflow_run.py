"""A tracked training run in MLflow's default store (in the storage root): interrupted, then resumed as the
same MLflow run, with system metrics, and its exported model logged, registered and generating."""

import json

import mt_ray.training.launch as launch
from jobs.train import main
from tests.conftest import StopAt

ARGS = ["training.steps=4", "checkpoint.every_steps=2", "data.max_seq_len=64", "engine.device=cpu",
        "training.log_every=1", "training.run_name=r", "tracking.system_metrics_interval_s=3600",
        "tracking.register_as=tiny-demo"]


def test_an_interrupted_run_resumes_its_mlflow_run_and_logs_a_model_that_generates(tmp_path, monkeypatch, capsys):
    import mlflow.transformers
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    build = launch.build_callbacks
    monkeypatch.setattr(launch, "build_callbacks", lambda cfg, run: [*build(cfg, run), StopAt(3)])
    assert main(ARGS) == 130  # Ctrl-C: one line naming the checkpoint and the command that resumes
    assert capsys.readouterr().err.strip().endswith(
        f"checkpoints/step-00000002; resume: python -m jobs.train {' '.join(ARGS)}")
    client = MlflowClient(f"sqlite:///{tmp_path}/runs/mlflow.db")
    experiment = client.get_experiment_by_name("mt-ray")
    [interrupted] = client.search_runs([experiment.experiment_id])
    assert interrupted.info.status == "KILLED" and interrupted.info.run_name == "r"

    monkeypatch.setattr(launch, "build_callbacks", build)
    assert main(ARGS) == 0
    assert "resuming run r from" in capsys.readouterr().out
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == interrupted.info.run_id and run.info.status == "FINISHED"
    # step 3, replayed from the checkpoint at 2, is logged once; the interrupt's error tag went with the resume
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4]
    assert interrupted.data.tags["mt_ray.error"].startswith("KeyboardInterrupt") and "mt_ray.error" not in run.data.tags
    # one closing sample per stretch, though each is far shorter than the hour's sampling interval
    assert [m.step for m in client.get_metric_history(run.info.run_id, "system/cpu_utilization_percentage")] == [0, 1]
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    assert run.data.tags["mt_ray.run_dir"] == f"{tmp_path}/runs/r"

    [output] = run.outputs.model_outputs
    summary = json.loads((tmp_path / "runs" / "r" / "summary.json").read_text())
    assert summary["mlflow_model"] == f"models:/{output.model_id}" and output.step == 4
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/runs/mlflow.db")  # load_model resolves models:/
    generate = mlflow.transformers.load_model("models:/tiny-demo/1")
    [out] = generate("What is 2 + 3?", max_new_tokens=5, do_sample=False)
    assert out["generated_text"].startswith("What is 2 + 3?")
