"""A Ray Tune sweep of short engine runs finishes and picks the best trial."""

import pytest

pytest.importorskip("ray")

from jobs.sweep import run_sweep  # noqa: E402


def test_four_trial_sweep_picks_the_lowest_loss(local_ray, tmp_path):
    best = run_sweep(num_samples=4, steps=6, storage_path=str(tmp_path), engine={"device": "cpu", "compute_dtype": "fp32"})
    assert best["trials"] == 4 and best["errors"] == 0
    assert set(best["config"]) == {"lr", "warmup", "batch"}
    assert best["loss"] == min(best["last_losses"])  # the best is the lowest last loss, stopped trials included
