"""Kill training with SIGKILL at chosen steps, resume from S3 each time: the final weights are
bit-identical to a run that never stopped, and the run is one MLflow run whose loss curve is that run's.

Each killed attempt kills itself right after its checkpoint of the chosen step is on S3
(`kill_after_checkpoint`), so the kills land at those steps however fast or loaded the machine is.
"""

import os
import signal
import subprocess
import sys
import uuid

import pytest
import torch
from mlflow import MlflowClient

from mt_ray.tracking import CheckpointConfig, CheckpointManager
from mt_ray.tracking.ckpt_s3 import build_s3_client
from tests.conftest import ROOT
from tests.integration.tracking.servers import moto_server

STEPS = 10
# Each attempt resumes from the previous kill's checkpoint; 2 then 3: killed again one step after a resume.
KILL_AFTER = (2, 3, 7)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret", "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    with moto_server(tmp_path_factory.mktemp("moto")) as url:
        bucket = f"ckpt-{uuid.uuid4().hex[:8]}"
        build_s3_client(CheckpointConfig(uri=f"s3://{bucket}", endpoint_url=url, region="us-east-1")).create_bucket(
            Bucket=bucket)
        yield url, bucket
    for k, v in old.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def command(url: str, storage: str, name: str, tmp_path, kill_after: int | None = None) -> list[str]:
    """`jobs.train` of this test's run; with `kill_after`, one that SIGKILLs itself after that step's checkpoint."""
    entry = ["jobs.train"] if kill_after is None else ["tests.integration.tracking.kill_after_checkpoint",
                                                       str(kill_after)]
    return [sys.executable, "-m", *entry, f"training.steps={STEPS}", "checkpoint.every_steps=1",
            f"training.storage={storage}", f"training.run_name={name}", f"checkpoint.endpoint_url={url}",
            "checkpoint.region=us-east-1", f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
            f"tracking.artifact_location={tmp_path / 'mlartifacts'}", "training.export=false", "engine.device=cpu",
            "data.max_seq_len=64", "training.micro_batch_size=2", "training.grad_accum_steps=2",
            "training.log_every=1"]


def run(cmd: list[str], cwd) -> subprocess.CompletedProcess:
    """Run `cmd` with this checkout's packages (not an installed copy), wherever `cwd` is."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    return subprocess.run(cmd, cwd=cwd, env=env, timeout=600, capture_output=True, text=True)


def manager(url: str, uri: str) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(uri=uri, endpoint_url=url, region="us-east-1"))


def checkpoint_step(uri: str | None) -> int:
    """The step of a checkpoint folder (`.../step-00000012/`); -1 for none."""
    return int(uri.rstrip("/").rsplit("-", 1)[1]) if uri else -1


def test_sigkill_and_resume_from_s3_is_exact(s3, tmp_path):
    url, bucket = s3
    storage = f"s3://{bucket}/runs"
    ref_uri, run_uri = f"{storage}/reference/checkpoints", f"{storage}/killed/checkpoints"
    done = run(command(url, storage, "reference", tmp_path), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]

    for target in KILL_AFTER:
        killed = run(command(url, storage, "killed", tmp_path, kill_after=target), tmp_path)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        assert checkpoint_step(manager(url, run_uri).latest()) == target
    done = run(command(url, storage, "killed", tmp_path), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resuming run killed from {storage}/killed/checkpoints/step-{KILL_AFTER[-1]:08d}" in done.stdout + done.stderr

    ref, ref_meta = manager(url, ref_uri).load()
    got, got_meta = manager(url, run_uri).load()
    assert got_meta["step"] == ref_meta["step"] == STEPS
    for name in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(ref[name], got[name]), name
    assert got_meta["trainer"]["history"][-1]["loss"] == ref_meta["trainer"]["history"][-1]["loss"]

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    found = client.search_runs([client.get_experiment_by_name("mt-ray").experiment_id])
    assert sorted((r.info.run_name, r.info.status) for r in found) == [("killed", "FINISHED"), ("reference", "FINISHED")]
    runs = {r.info.run_name: r for r in found}
    reference = {m.step: m.value for m in client.get_metric_history(runs["reference"].info.run_id, "loss")}
    killed = client.get_metric_history(runs["killed"].info.run_id, "loss")
    # One run, one curve: every step once or, where a killed attempt logged it before dying, again with the
    # same value (the resumed run recomputes it exactly).
    assert {m.step for m in killed} == set(reference) == set(range(1, STEPS + 1))
    assert all(m.value == reference[m.step] for m in killed)
    resumes = client.get_metric_history(runs["killed"].info.run_id, "resumed_at_step")
    assert [(m.step, m.value) for m in resumes] == [(step, step) for step in KILL_AFTER]
