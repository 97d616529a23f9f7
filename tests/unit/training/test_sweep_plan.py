"""What a sweep decides before Tune runs: storage, resume, each trial's config, the resources a trial holds."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytest.importorskip("ray")

from mt_ray.config.run import load_run_config, load_run_values  # noqa: E402
from mt_ray.config.sweep import SweepConfig, build_space  # noqa: E402
from mt_ray.errors import ConfigError  # noqa: E402
from mt_ray.tracking import CheckpointConfig, TrackingConfig  # noqa: E402
from mt_ray.training.run_dir import RAY_JOB_ENV, run_tracking_config  # noqa: E402
from mt_ray.training.sweep import (  # noqa: E402
    TrialPlan,
    absolute_paths,
    build_search,
    check_resume,
    pin_tracking,
    trial_resources,
)
from mt_ray.training.sweep_storage import SweepStorage  # noqa: E402

BASE = load_run_values(None, ["data.val_size=16", "training.eval_every=2", "training.steps=6"])
SPACE = build_space({"optimizer.lr": {"loguniform": [1e-4, 1e-2]}}, BASE)


def test_storage_that_cannot_be_written_is_refused_with_the_fix(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=rf"sweep storage {blocker}/s is not writable \(.*\); pass a --storage folder "
                                          "you can write to, or s3://bucket/prefix"):
        SweepStorage(str(blocker), "s", CheckpointConfig())


def test_relative_sweep_storage_is_refused_under_a_ray_job_naming_the_flag(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(RAY_JOB_ENV, "{}")
    with pytest.raises(ConfigError, match=r"--storage: 'sweeps' is a relative path, and this is a Ray job.*"
                                          r"e\.g\. --storage=\$PWD/sweeps"):
        SweepStorage("sweeps", "s", CheckpointConfig())
    assert not (tmp_path / "sweeps").exists()


def test_resume_only_the_same_sweep(tmp_path):
    storage = SweepStorage(str(tmp_path), "s", CheckpointConfig())
    with pytest.raises(ConfigError, match=r"there is no sweep to resume at .*/s; run without --resume"):
        check_resume(storage, True, BASE, SPACE)
    assert check_resume(storage, False, BASE, SPACE) is None
    storage.write_record({"base": BASE, "space": [d.describe() for d in SPACE], "run_id": None})
    with pytest.raises(ConfigError, match=r"a sweep named 's' already exists at .*; pass --resume to continue it, or "
                                          "--name to start another"):
        check_resume(storage, False, BASE, SPACE)
    assert check_resume(storage, True, BASE, SPACE)["run_id"] is None
    other = build_space({"optimizer.lr": {"loguniform": [1e-5, 1e-2]}}, BASE)
    with pytest.raises(ConfigError, match=r"was started with another run config or space"):
        check_resume(storage, True, BASE, other)


def test_a_trial_is_a_run_of_its_own_with_its_sampled_values(tmp_path):
    storage = SweepStorage(str(tmp_path / "sweeps"), "s", CheckpointConfig())
    base = absolute_paths({**BASE, "training": {**BASE["training"], "storage": str(tmp_path)}})
    base = pin_tracking(base, run_tracking_config(TrackingConfig(), "s", str(tmp_path)))
    cfg = TrialPlan(base, storage, "parent-id", "s").trial_config(
        {"optimizer.lr": np.float64(3e-3), "model.overrides.num_hidden_layers": np.int64(1)}, "t1")
    assert cfg.optimizer.lr == 3e-3 and cfg.model.overrides == {"num_hidden_layers": 1}
    assert cfg.training.storage == f"{tmp_path}/sweeps/s/trials" and cfg.training.run_name == "s-t1"
    assert cfg.training.resume == "auto"
    assert cfg.tracking.parent_run_id == "parent-id" and cfg.tracking.tags["mt_ray.sweep.trial_id"] == "t1"
    # Every trial logs to the store of the sweep's storage root, not to one in its own run folder.
    assert cfg.tracking.tracking_uri == f"sqlite:///{tmp_path}/mlflow.db"
    assert "optimizer" not in BASE and "model" not in BASE  # the base is untouched


def test_a_trial_reserves_its_process_or_its_whole_data_parallel_group():
    single = load_run_config(None, ["engine.device=auto"])
    assert trial_resources(single, SweepConfig(), cluster_has_gpus=True) == {"cpu": 1.0, "gpu": 1}
    assert trial_resources(single, SweepConfig(), cluster_has_gpus=False) == {"cpu": 1.0, "gpu": 0}
    assert trial_resources(single, SweepConfig(gpus_per_trial=0.5), True) == {"cpu": 1.0, "gpu": 0.5}
    group = trial_resources(load_run_config(None, ["cluster.num_workers=2"]), SweepConfig(), cluster_has_gpus=True)
    # The trial's process, then one bundle per worker (the coordinator reserves no CPU unless asked).
    assert group.bundles == [{"CPU": 1.0}, {"CPU": 1.0, "GPU": 1}, {"CPU": 1.0, "GPU": 1}]
    with pytest.raises(ConfigError, match="cluster.num_nodes=1"):
        trial_resources(load_run_config(None, ["cluster.num_workers=2", "cluster.num_nodes=2"]), SweepConfig(), True)


def test_optuna_search_cannot_run_a_grid_and_names_its_install():
    grid = build_space({"optimizer.lr": {"grid": [1e-3, 1e-4]}}, BASE)
    with pytest.raises(ConfigError, match="--search optuna cannot run a grid sampler; use choice instead"):
        build_search(SweepConfig(search="optuna"), grid, seed=0)
    if importlib.util.find_spec("optuna") is None:
        with pytest.raises(ConfigError, match=r"--search optuna needs Optuna: pip install 'mt-ray\[sweep\]'"):
            build_search(SweepConfig(search="optuna"), SPACE, seed=0)
    else:
        assert type(build_search(SweepConfig(search="optuna", max_concurrent=2), SPACE, seed=0)).__name__ == \
            "ConcurrencyLimiter"


def test_a_sweep_logged_to_a_file_has_no_colour_codes_or_tune_tables(monkeypatch):
    """Under pytest stdout and stderr are files, as in `mt-ray sweep ... > sweep.log`: Ray prints its workers' lines
    (each trial's run) without ANSI colour codes, and Tune prints none of its box tables."""
    import io

    from ray._private.worker import print_worker_logs

    from mt_ray.training.sweep import tune_settings, tune_verbosity
    from mt_ray.verbosity import quiet_libraries

    monkeypatch.setenv("RAY_COLOR_PREFIX", "1")  # recorded, so what quiet_libraries sets is undone after
    monkeypatch.delenv("RAY_COLOR_PREFIX")
    quiet_libraries()
    log = io.StringIO()
    print_worker_logs({"pid": 4242, "ip": "10.0.0.1", "localhost": "10.0.0.1", "task_name": "trial",
                       "lines": ["step 2/6: loss 5.000"]}, log)
    assert log.getvalue() == "(trial pid=4242) step 2/6: loss 5.000\n"
    # Tune's legacy output engine, silent at verbosity 0 (the new one prints a box table of the experiment anyway)
    assert tune_verbosity() == 0 and tune_settings()["RAY_AIR_NEW_OUTPUT"] == "0"
