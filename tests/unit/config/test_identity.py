"""A run's identity: which keys change its fingerprint, its generated name, the diff of changed keys."""

import pytest

from mt_ray.config.identity import changed_keys, run_identity
from mt_ray.config.run import load_run_config
from mt_ray.errors import ConfigError


def identity(*overrides: str):
    return run_identity(load_run_config(None, list(overrides)))


def test_the_same_config_has_the_same_identity_and_a_readable_name():
    a, b = identity(), identity()
    assert a == b and len(a.fingerprint) == 8
    assert a.name == f"tiny-demo_alpaca+demo_sharegpt-{a.fingerprint}"
    assert a.keys["data.max_seq_len"] == 256 and a.keys["training.steps"] == 60


@pytest.mark.parametrize("override", ["data.datasets=[demo_alpaca]", "optimizer.lr=0.01", "training.steps=61",
                                      "training.seed=1", "model.overrides={num_hidden_layers: 1}",
                                      "training.grad_accum_steps=4"])
def test_keys_that_change_training_change_the_fingerprint(override):
    assert identity(override).fingerprint != identity().fingerprint


@pytest.mark.parametrize("override", ["engine.device=cpu", "engine.checkpoint_every=1", "cluster.num_workers=2",
                                      "training.log_every=1", "checkpoint.every_steps=1", "tracking.enabled=false",
                                      "training.storage=/elsewhere", "training.export=false"])
def test_how_and_where_a_run_computes_do_not(override):
    assert identity(override) == identity()


def test_a_given_name_keeps_the_fingerprint_and_long_names_stay_folder_names():
    assert identity("training.run_name=mine").name == "mine"
    assert identity("training.run_name=mine").fingerprint == identity().fingerprint
    many = identity("data.datasets=[demo_alpaca, demo_sharegpt, demo_alpaca, demo_sharegpt]")
    assert many.name == f"tiny-demo_alpaca+3-{many.fingerprint}"


def test_changed_keys_name_each_key_with_both_values():
    old, new = identity().keys, identity("data.datasets=[demo_alpaca]", "optimizer.lr=0.01").keys
    assert changed_keys(old, new) == ['data.datasets: ["demo_alpaca", "demo_sharegpt"] -> ["demo_alpaca"]',
                                      "optimizer.lr: 0.001 -> 0.01"]
    assert changed_keys({"a": 1}, {"b": 2}) == ["a: 1 -> (unset)", "b: (unset) -> 2"]


def test_a_section_given_in_part_keeps_the_demos_other_defaults():
    cfg = load_run_config(None, ["data.datasets=[demo_alpaca]", "optimizer.lr=0.01", "checkpoint.keep_last=1"])
    assert cfg.data.max_seq_len == 256 and cfg.optimizer.warmup_steps == 5 and cfg.checkpoint.every_steps == 50


@pytest.mark.parametrize(("override", "message"), [
    ("checkpoint.uri=/x", r"checkpoint\.uri: checkpoints go to <training\.storage>/<run name>/checkpoints"),
    ("tracking.run_name=x", r"tracking\.run_name: .* set training\.run_name instead"),
    ("training.run_name=a/b", r"training\.run_name: 'a/b' names a folder"),
    ("training.storage=gs://bucket/runs", r"training\.storage: uri must be a local directory or s3://"),
])
def test_keys_the_run_sets_and_bad_names_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(None, [override])


def test_a_grpo_runs_fingerprint_counts_its_grpo_section_but_not_its_logging():
    grpo = ("training.stage=grpo", "grpo.num_generations=4", "data.datasets=[demo_math_prompts]")
    assert identity(*grpo, "grpo.beta=0.04").fingerprint != identity(*grpo).fingerprint
    assert identity(*grpo, "grpo.log_completions_every=1") == identity(*grpo)
    assert "grpo.beta" not in identity().keys  # an SFT run's keys are as before
