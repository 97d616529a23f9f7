"""A sweep's space file and options: checked before anything runs, each mistake named with its key and fix."""

from __future__ import annotations

import pytest

from mt_ray.cli.main import main
from mt_ray.config.run import load_run_config, load_run_values
from mt_ray.config.sweep import SweepConfig, build_space, load_space, load_sweep_config
from mt_ray.errors import ConfigError
from tests.conftest import ROOT

BASE = load_run_values(None, ["data.val_size=16", "training.eval_every=2", "training.steps=6"])


def test_a_space_of_dotted_keys_and_samplers_reads_back_readably(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text("optimizer.lr: {loguniform: [1.0e-5, 1.0e-3]}\noptimizer.warmup_steps: {choice: [0, 5]}\n"
                    "model.overrides.num_hidden_layers: {grid: [1, 2]}\noptimizer.min_lr_ratio: {uniform: [0, 0.5]}\n")
    space = load_space(path, BASE)
    assert [d.describe() for d in space] == ["loguniform(1e-05, 0.001)", "choice([0, 5])", "grid([1, 2])",
                                             "uniform(0.0, 0.5)"]
    assert [d.key for d in space] == ["optimizer.lr", "optimizer.warmup_steps", "model.overrides.num_hidden_layers",
                                      "optimizer.min_lr_ratio"]


@pytest.mark.parametrize(("key", "message"), [
    ("optimizer.lrr", r"space key 'optimizer.lrr' is not in the run config: section 'optimizer' has no key 'lrr'; "
                      r"did you mean optimizer.lr\?"),
    ("optimiser.lr", r"the top level has no key 'optimiser'; did you mean optimizer.lr\?"),
    ("optimizer", r"space key 'optimizer' is a whole section; name one of its keys, e.g. optimizer.lr"),
    ("optimizer.lr.x", r"'optimizer.lr' is a value, not a section"),
    ("training.steps", r"space key 'training.steps' cannot be swept: ASHA measures trials in steps"),
    ("tracking.experiment", r"cannot be swept: each trial is an MLflow child run"),
])
def test_a_key_that_is_not_a_sweepable_run_config_key_is_refused(key, message):
    with pytest.raises(ConfigError, match=message):
        build_space({key: {"choice": [1, 2]}}, BASE)


@pytest.mark.parametrize(("spec", "message"), [
    ({"loguniform": [1e-3, 1e-5]}, r"space key 'optimizer.lr': loguniform bounds \[0.001, 1e-05\] are not increasing"),
    ({"loguniform": [0, 1e-3]}, r"loguniform needs 0 < low, got \[0, 0.001\]; use uniform"),
    ({"uniform": [-1e-3, 1e-3]}, r"uniform\(-0.001, 0.001\) can draw -0.001, which the run config refuses "
                                 r"\(optimizer.lr: Input should be greater than 0\); narrow the sampler"),
    ({"uniform": [1e-3]}, r"uniform needs \[low, high\] as two numbers"),
    ({"choice": []}, r"choice needs a non-empty list of values"),
    ({"logunifrom": [1e-5, 1e-3]}, r"unknown sampler 'logunifrom'; did you mean loguniform\?"),
    ({"loguniform": [1e-5, 1e-3], "choice": [1]}, r"give exactly one sampler"),
    (1e-4, r"give exactly one sampler"),
])
def test_a_sampler_with_bad_bounds_or_values_is_refused(spec, message):
    with pytest.raises(ConfigError, match=message):
        build_space({"optimizer.lr": spec}, BASE)


def test_a_range_whose_midpoint_is_not_a_valid_value_is_refused():
    with pytest.raises(ConfigError, match=r"'optimizer.warmup_steps': uniform\(0.0, 5.0\) can draw 2.5.*valid integer"):
        build_space({"optimizer.warmup_steps": {"uniform": [0, 5]}}, BASE)


def test_a_sweep_needs_an_eval_split_and_eval_every():
    with pytest.raises(ConfigError, match=r"a sweep judges trials on eval_loss: set data.val_size"):
        SweepConfig().checked(load_run_config(None, ["data.val_size=16"]))
    with pytest.raises(ConfigError, match=r"--grace-steps 8 is beyond training.steps \(6\)"):
        SweepConfig(grace_steps=8).checked(load_run_config(None, ["data.val_size=16", "training.eval_every=2",
                                                                  "training.steps=6"]))
    assert SweepConfig().checked(load_run_config(None, ["data.val_size=16", "training.eval_every=3"])).grace_steps == 3


def test_a_dpo_sweep_may_judge_trials_on_reward_accuracy_highest_first():
    evals = ["data.val_size=16", "training.eval_every=2"]
    accuracy = SweepConfig(metric="eval_rewards/accuracies")
    assert (accuracy.mode, SweepConfig().mode) == ("max", "min")
    assert accuracy.checked(load_run_config(None, [*evals, "training.stage=dpo", "data.datasets=dpo_en_demo"]))
    with pytest.raises(ConfigError, match=r"--metric eval_rewards/accuracies is reported by training.stage dpo only "
                                          r"\(this run's is kto\); use --metric eval_loss"):
        accuracy.checked(load_run_config(None, [*evals, "training.stage=kto"]))
    with pytest.raises(ConfigError, match=r"--metric: Input should be 'eval_loss' or 'eval_rewards/accuracies'"):
        load_sweep_config({"metric": "eval_accuracy"})


def test_bad_options_name_the_flag():
    with pytest.raises(ConfigError, match=r"--samples: Input should be greater than or equal to 1"):
        load_sweep_config({"samples": 0, "name": None})
    assert load_sweep_config({"samples": None, "search": "optuna"}) == SweepConfig(search="optuna")


def test_the_shipped_space_fits_the_demo_config():
    demo = load_run_values(ROOT / "jobs/configs/demo.yaml", ["data.val_size=0.05", "training.eval_every=10"])
    assert [d.key for d in load_space(ROOT / "jobs/spaces/demo.yaml", demo)] == ["optimizer.lr", "optimizer.warmup_steps"]


def test_the_cli_names_a_bad_space_key_in_one_line(tmp_path, capsys):
    space = tmp_path / "space.yaml"
    space.write_text("optimizer.lrr: {loguniform: [1.0e-5, 1.0e-3]}\n")
    assert main(["sweep", "--config", str(ROOT / "jobs/configs/demo.yaml"), "--space", str(space),
                 "data.val_size=16", "training.eval_every=2"]) == 2
    err = capsys.readouterr().err
    assert "mt-ray sweep: error: space key 'optimizer.lrr'" in err and "did you mean optimizer.lr?" in err
    assert "Traceback" not in err
