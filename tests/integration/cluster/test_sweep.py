"""A Ray Tune sweep of jobs/configs/demo.yaml judged on held-out eval loss: MLflow child runs, ASHA, the best config.

The sweep runs one trial at a time, so ASHA sees the trials in a fixed order and, with CPU training
deterministic, stops the same ones on every run.
"""

import contextlib
import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray")

from mt_ray.cli.main import main  # noqa: E402
from mt_ray.config.run import load_run_values  # noqa: E402
from mt_ray.config.sweep import SweepConfig, build_space, load_space  # noqa: E402
from mt_ray.training.sweep import run_sweep  # noqa: E402
from tests.conftest import ROOT  # noqa: E402
from tests.integration.cluster.demo_sweep import (  # noqa: E402
    DEMO,
    DEMO_OVERRIDES,
    SPACE,
    STEPS,
    FailAtFirstEval,
    SlowEnd,
)


@pytest.fixture(scope="module")
def sweep(local_ray, tmp_path_factory):
    """A 4-trial sweep over optimizer.lr and optimizer.warmup_steps, trials exporting their model, tracked in
    SQLite at a path relative to where it was launched (`sqlite:///sweep.db`, MLflow's documented form, as a
    user writes it); returns (summary, store URI, tmp)."""
    tmp = tmp_path_factory.mktemp("sweep")
    launched = tmp / "launched"
    launched.mkdir()
    base = load_run_values(DEMO, [*DEMO_OVERRIDES, "training.export=true", f"training.storage={tmp}",
                                  "tracking.tracking_uri=sqlite:///sweep.db", "tracking.experiment=sweep"])
    with contextlib.chdir(launched):  # each trial runs in a folder of Ray's, where sweep.db would be another file
        summary = run_sweep(base, load_space(SPACE, base), SweepConfig(samples=4, max_concurrent=1, name="demo"))
    return summary, f"sqlite:///{launched / 'sweep.db'}", tmp


def test_every_trial_logs_to_the_one_store_where_the_sweep_was_launched(sweep):
    _, _, tmp = sweep
    # The store the user named and its artifacts beside it; no ./mlruns, and no other MLflow database anywhere.
    assert sorted(p.name for p in (tmp / "launched").iterdir()) == ["mlartifacts", "sweep.db"]
    assert [p.relative_to(tmp) for p in tmp.rglob("*.db")] == [Path("launched/sweep.db")]


def child_runs(client, parent_id: str) -> list:
    parent = client.get_run(parent_id)
    return client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")


def test_every_trial_is_a_finished_child_run_with_an_eval_curve(sweep):
    from mlflow import MlflowClient

    summary, uri, _ = sweep
    client = MlflowClient(uri)
    children = child_runs(client, summary["run_id"])
    assert summary["trials"] == len(children) == 4 and summary["errors"] == 0
    for child in children:
        assert child.info.status == "FINISHED"
        steps = [m.step for m in client.get_metric_history(child.info.run_id, "eval_loss")]
        assert sorted(steps) == list(range(2, max(steps) + 1, 2))  # every 2 steps, until ASHA stops it or the end
        assert set(yaml.safe_load(child.data.tags["mt_ray.sweep.sampled"])) == {"optimizer.lr", "optimizer.warmup_steps"}
        assert float(child.data.params["optimizer.lr"]) == yaml.safe_load(child.data.tags["mt_ray.sweep.sampled"])[
            "optimizer.lr"]  # an ordinary run's params, with the sampled value


def test_asha_stops_trials_that_fall_behind(sweep):
    from mlflow import MlflowClient

    summary, uri, _ = sweep
    client = MlflowClient(uri)
    stopped = [c for c in child_runs(client, summary["run_id"]) if c.data.tags.get("mt_ray.sweep.stopped_early")]
    assert summary["stopped_early"] == len(stopped) >= 1
    for child in stopped:
        assert max(m.step for m in client.get_metric_history(child.info.run_id, "eval_loss")) < STEPS


def test_the_sweep_run_shows_the_space_readably_and_links_the_best_trial(sweep, tmp_path):
    from mlflow import MlflowClient

    summary, uri, _ = sweep
    client = MlflowClient(uri)
    parent = client.get_run(summary["run_id"])
    params = parent.data.params
    assert params["space.optimizer.lr"] == "loguniform(0.0001, 0.01)"
    assert params["space.optimizer.warmup_steps"] == "choice([0, 5])"
    assert params["sweep.samples"] == "4" and "optimizer.lr" not in params  # no base value posing as the trials'
    assert not [v for v in params.values() if " object at 0x" in v]
    assert parent.info.status == "FINISHED" and parent.data.tags["best_run_id"] == summary["best_run_id"]
    if summary["best_step"] == STEPS:  # trials that ran to the end exported their model; ASHA's stopped ones did not
        [model] = client.search_logged_models([parent.info.experiment_id], f"source_run_id = '{summary['best_run_id']}'")
        assert parent.data.tags["best_model_uri"] == summary["best_model_uri"] == f"models:/{model.model_id}"
    best = client.get_run(summary["best_run_id"])
    assert best.data.metrics["eval_loss"] == pytest.approx(summary["best_eval_loss"])
    assert summary["best_eval_loss"] == min(c.data.metrics["eval_loss"] for c in child_runs(client, summary["run_id"]))
    logged = yaml.safe_load(Path(client.download_artifacts(parent.info.run_id, "best_config.yaml", str(tmp_path)))
                            .read_text())
    assert logged == yaml.safe_load(Path(summary["best_config_path"]).read_text())


def test_the_best_config_trains_with_mt_ray_train(sweep):
    summary, _, tmp = sweep
    best = yaml.safe_load(Path(summary["best_config_path"]).read_text())
    assert best["optimizer"]["lr"] == summary["best_config"]["optimizer.lr"]
    assert main(["train", "--config", summary["best_config_path"], f"training.storage={tmp / 'best'}",
                 "tracking.enabled=false"]) == 0
    [written] = (tmp / "best").glob("*/summary.json")
    trained = json.loads(written.read_text())
    assert trained["steps"] == STEPS
    if summary["best_step"] == STEPS:  # the same run again: the same eval loss (up to thread-count rounding)
        assert trained["eval_loss"] == pytest.approx(summary["best_eval_loss"], rel=1e-3)


def test_a_dpo_sweep_keeps_the_trial_with_the_highest_eval_reward_accuracy(local_ray, tmp_path):
    """`--metric eval_rewards/accuracies` on the DPO demo: every trial reports its held-out reward accuracy (and no
    eval perplexity, which a preference run does not have). lr 2e-2 overshoots: at step 2 its accuracy is below
    lr 1e-5's, so ASHA, maximising, stops it there, and the best trial is the other. Each outcome is forced, not
    left to load: the stopped trial takes 4 s to end its run (longer than Tune takes to end its process, unless the
    stop waits for the run), and the trial with lr 3e-2 fails at its first evaluation. The stopped trial's run is
    FINISHED with its summary and stop reason; the failed one counts in `errors`, named, and its run is FAILED with
    its error."""
    from mlflow import MlflowClient

    base = load_run_values(str(ROOT / "jobs/configs/dpo_demo.yaml"), [
        "training.steps=4", "training.eval_every=2", "data.val_size=8", "data.max_seq_len=128",
        "training.grad_accum_steps=1", "engine.device=cpu", "training.export=false", f"training.storage={tmp_path}",
        f"tracking.tracking_uri=sqlite:///{tmp_path / 'sweep.db'}", "tracking.experiment=dpo-sweep"])
    space = build_space({"optimizer.lr": {"grid": [1.0e-5, 2.0e-2, 3.0e-2]}}, base)
    summary = run_sweep(base, space, SweepConfig(samples=1, max_concurrent=1, name="dpo",
                                                 metric="eval_rewards/accuracies"),
                        trial_callbacks=[FailAtFirstEval(3.0e-2), SlowEnd(4.0)])
    assert summary["metric"] == "eval_rewards/accuracies" and summary["trials"] == 3 and summary["errors"] == 1
    [(failed_id, error)] = summary["trial_errors"].items()
    assert error == "RuntimeError: forced failure of the trial with lr 0.03"
    assert summary["stopped_early"] == 1 and summary["best_config"] == {"optimizer.lr": 1.0e-5}
    [written] = (tmp_path / "sweeps" / "dpo" / "trials").glob(f"*{summary['best_trial']}/summary.json")
    best = json.loads(written.read_text())
    assert summary["best_value"] == best["eval_rewards/accuracies"] and summary["best_eval_loss"] == best["eval_loss"]
    assert "eval_perplexity" not in best

    client = MlflowClient(f"sqlite:///{tmp_path / 'sweep.db'}")
    runs = {r.data.tags["mt_ray.sweep.trial_id"]: r for r in child_runs(client, summary["run_id"])}
    assert runs[failed_id].info.status == "FAILED" and runs[failed_id].data.tags["mt_ray.error"] == error
    [stopped] = [r for r in runs.values() if "mt_ray.sweep.stopped_early" in r.data.tags]
    assert stopped.info.status == runs[summary["best_trial"]].info.status == "FINISHED"
    assert stopped.data.tags["mt_ray.sweep.stopped_early"] == "stopped by the scheduler at step 2"
    assert stopped.data.metrics["summary.steps"] == 2  # it ended its run (summary, checkpoint) before its process
