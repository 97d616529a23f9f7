"""A sweep submitted with `ray job submit` to a `ray start --head` cluster, killed after 2 trials, then resumed.

The resumed sweep keeps the finished trials (their outputs are not written again) and runs the
others, the one killed mid-run restarting from its newest checkpoint. Trials run one at a time,
30 steps each with no early stopping (grace = steps), so each runs long enough to be killed in.
"""

import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.integration.cluster.demo_sweep import DEMO, DEMO_OVERRIDES, SPACE

pytest.importorskip("ray")

ENV = {"PYTHONPATH": str(ROOT)}


def finished_trials(trials: Path) -> dict[Path, int]:
    """Each finished trial's summary.json and when it was written."""
    return {p: p.stat().st_mtime_ns for p in trials.glob("*/summary.json")}


# Bounds for a 2-core machine running another suite beside this one (each trial then takes minutes), not speed checks.
BOUND_S = 900


def wait_until(condition, head, job_id: str, timeout_s: float = BOUND_S) -> None:
    """Poll `condition` often; fail when the job ended first (its status is asked every few seconds: a CLI call)."""
    deadline = next_status = time.monotonic()
    deadline += timeout_s
    while not condition():
        if time.monotonic() >= next_status:
            status = head.status(job_id).upper()
            if "FAILED" in status or "SUCCEEDED" in status or time.monotonic() > deadline:
                pytest.fail(f"job {job_id} did not reach the expected state: {status}\n{head.logs(job_id)[-3000:]}")
            next_status = time.monotonic() + 5
        time.sleep(0.2)


def test_a_submitted_sweep_killed_after_two_trials_resumes_without_redoing_them(ray_head, tmp_path):
    storage, name = tmp_path / "sweeps", "resumable"
    trials = storage / name / "trials"
    command = [sys.executable, "-m", "jobs.sweep", "--config", DEMO, "--space", SPACE, "--samples", "4",
               "--max-concurrent", "1", "--grace-steps", "30", "--storage", str(storage), "--name", name,
               *DEMO_OVERRIDES, "training.steps=30", "training.eval_every=10", f"training.storage={tmp_path}",
               "tracking.enabled=false"]
    ray_head.submit("sweep-1", command, ENV)

    def third_trial_checkpointed() -> bool:
        running = [t for t in trials.glob("*") if not (t / "summary.json").exists()]
        return len(finished_trials(trials)) >= 2 and any((t / "checkpoints").glob("step-*") for t in running)

    wait_until(third_trial_checkpointed, ray_head, "sweep-1")
    kept = finished_trials(trials)
    ray_head.stop("sweep-1")
    assert "SUCCEEDED" not in ray_head.status("sweep-1").upper()
    killed = [t.name for t in trials.glob("*") if not (t / "summary.json").exists() and any(t.glob("checkpoints/step-*"))]

    ray_head.submit("sweep-2", [*command, "--resume"], ENV)
    logs = ray_head.logs("sweep-2", follow=True, timeout=BOUND_S)
    assert "SUCCEEDED" in ray_head.status("sweep-2").upper(), logs[-3000:]
    assert "4 trials" in logs and "train it: mt-ray train --config" in logs
    after = finished_trials(trials)
    assert len(after) == 4 and 2 <= len(kept) < 4
    assert {p: after[p] for p in kept} == kept  # the finished trials were not run again
    for name in killed:  # a trial killed mid-run continued from its newest checkpoint
        assert f"resuming run {name} from {trials / name}/checkpoints/step-" in logs


def test_a_submitted_sweep_with_a_relative_tracking_uri_is_refused_with_the_absolute_form(ray_head, tmp_path):
    """Under `ray job submit` the working directory is Ray's copy of the package: `sqlite:///sweep.db` would be a
    file there, deleted with the cluster, and each trial's run another file in its own folder."""
    command = [sys.executable, "-m", "jobs.sweep", "--config", DEMO, "--space", SPACE, "--samples", "2",
               "--storage", str(tmp_path / "sweeps"), *DEMO_OVERRIDES, f"training.storage={tmp_path}",
               "tracking.tracking_uri=sqlite:///sweep.db"]
    ray_head.submit("relative-uri", command, ENV)
    logs = ray_head.logs("relative-uri", follow=True)
    assert "FAILED" in ray_head.status("relative-uri").upper(), logs[-3000:]
    assert ("error: tracking.tracking_uri: 'sweep.db' is a relative path, and this is a Ray job" in logs
            and "e.g. tracking.tracking_uri=sqlite:///$PWD/sweep.db" in logs), logs[-3000:]
    assert not (tmp_path / "sweeps").exists()  # refused before anything was written
