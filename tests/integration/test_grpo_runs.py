"""A GRPO run's completions in MLflow, and a resume between the iterations of a rollout equal to a run never
stopped. Each run is the demo config, shortened, on the CPU, through the run entry (`launch.run`)."""

import pytest
import torch

import mt_ray.training.launch as launch
from jobs.rewards import digits
from mt_ray.config.run import load_run_config
from mt_ray.tracking import CheckpointConfig, CheckpointManager
from tests.conftest import RecordLogs, StopAt

DEMO = "jobs/configs/grpo_demo.yaml"


def demo(tmp_path, *overrides: str):
    return load_run_config(DEMO, [f"training.storage={tmp_path}", "engine.device=cpu", "training.export=false",
                                  "training.log_every=1", "grpo.max_completion_length=8", *overrides])


def test_every_nth_steps_completions_are_an_mlflow_table(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    store = f"sqlite:///{tmp_path}/mlflow.db"  # a local store in one file (MLflow 3 refuses the folder store)
    launch.run(demo(tmp_path, "training.steps=4", "grpo.log_completions_every=2", f"tracking.tracking_uri={store}",
                    "tracking.system_metrics=false"))
    client = mlflow.MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("mt-ray").experiment_id])
    logged = sorted(f.path for f in client.list_artifacts(run.info.run_id, "completions"))
    assert logged == ["completions/step-00000002.json", "completions/step-00000004.json"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)  # load_table searches the runs through the global store
    table = client.load_table(run.info.experiment_id, "completions/step-00000004.json", run_ids=[run.info.run_id])
    assert list(table.columns) == ["step", "prompt", "completion", "accuracy", "format", "digits", "advantage"]
    assert len(table) == 16 and set(table["step"]) == {4}
    assert table["digits"].tolist() == pytest.approx(digits(table["prompt"].tolist(), table["completion"].tolist()))
    groups = torch.tensor(table["advantage"].tolist()).view(4, 4)  # each prompt's G=4 completions, in order
    prompts = table["prompt"].tolist()
    assert groups.sum(dim=1).abs().max() < 1e-5 and len(set(prompts)) == 4 and prompts[::4] == prompts[3::4]


def test_a_resume_between_a_rollouts_iterations_equals_the_run_never_stopped(tmp_path, monkeypatch):
    """Two iterations a rollout; stopped after step 3 (the second rollout's first step, checkpointed there), the
    resumed run trains step 4 on that rollout's completions and old log-probs, then draws the same prompts on."""
    common = ["training.steps=6", "grpo.num_iterations=2", "checkpoint.every_steps=1", "tracking.enabled=false"]
    whole = RecordLogs()
    launch.run(demo(tmp_path, *common, "training.run_name=whole"), [whole])

    build = launch.build_callbacks
    monkeypatch.setattr(launch, "build_callbacks", lambda cfg, run: [*build(cfg, run), StopAt(3)])
    with pytest.raises(launch.RunInterrupted):
        launch.run(demo(tmp_path, *common, "training.run_name=cut"))
    monkeypatch.setattr(launch, "build_callbacks", build)
    resumed = RecordLogs()
    summary = launch.run(demo(tmp_path, *common, "training.run_name=cut"), [resumed])

    def trained(logged: list[dict]) -> list[dict]:  # what the steps computed (not their times or memory)
        return [{k: v for k, v in m.items() if k.startswith(("loss", "grad_norm", "reward", "completions/", "clip_"))}
                for m in logged]

    assert trained(resumed.logged) == trained(whole.logged[3:])
    assert whole.logged[3]["clip_ratio/region_mean"] > 0  # step 4 trained on old log-probs, not its own
    assert summary["data"]["prompts"] == 3 * 4
    final = [CheckpointManager(CheckpointConfig(uri=str(tmp_path / name / "checkpoints"))).load()[0]
             for name in ("whole", "cut")]
    for key, tensor in final[0].items():
        assert torch.equal(tensor, final[1][key]), key
