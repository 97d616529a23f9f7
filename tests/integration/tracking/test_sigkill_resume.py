"""Kill training with SIGKILL at random steps, resume from S3 each time: the final weights are
bit-identical to a run that never stopped, and the run is one MLflow run whose loss curve is that run's."""

import os
import random
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
from mlflow import MlflowClient

from mt_ray.tracking import CheckpointConfig, CheckpointManager
from mt_ray.tracking.ckpt_s3 import build_s3_client
from tests.integration.tracking.servers import moto_server

STEPS = 10


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


def command(url: str, storage: str, name: str, tmp_path) -> list[str]:
    return [sys.executable, "-m", "jobs.train", f"training.steps={STEPS}", "checkpoint.every_steps=1",
            f"training.storage={storage}", f"training.run_name={name}", f"checkpoint.endpoint_url={url}",
            "checkpoint.region=us-east-1", f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
            f"tracking.artifact_location={tmp_path / 'mlartifacts'}", "training.export=false", "engine.device=cpu",
            "data.max_seq_len=64", "training.micro_batch_size=2", "training.grad_accum_steps=2",
            "training.log_every=1"]


def run(cmd: list[str], cwd) -> None:
    done = subprocess.run(cmd, cwd=cwd, timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def manager(url: str, uri: str) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(uri=uri, endpoint_url=url, region="us-east-1"))


def checkpoint_step(uri: str | None) -> int:
    """The step of a checkpoint folder (`.../step-00000012/`); -1 for none."""
    return int(uri.rstrip("/").rsplit("-", 1)[1]) if uri else -1


def test_sigkill_and_resume_from_s3_is_exact(s3, tmp_path):
    url, bucket = s3
    storage = f"s3://{bucket}/runs"
    ref_uri, run_uri = f"{storage}/reference/checkpoints", f"{storage}/killed/checkpoints"
    run(command(url, storage, "reference", tmp_path), tmp_path)

    rng = random.Random(0)
    kills = 0
    for target in sorted(rng.sample(range(2, STEPS - 1), 3)):
        start = checkpoint_step(manager(url, run_uri).latest())
        proc = subprocess.Popen(command(url, storage, "killed", tmp_path), cwd=tmp_path, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            # Killed once this attempt has saved a checkpoint of its own: it has resumed (and logged it) by then,
            # even where a slow poll let the last attempt save past this target.
            latest = checkpoint_step(manager(url, run_uri).latest())
            if latest >= target and latest > start:
                os.killpg(proc.pid, signal.SIGKILL)
                kills += 1
                break
            time.sleep(0.2)
        proc.wait()
    assert kills >= 2
    run(command(url, storage, "killed", tmp_path), tmp_path)

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
    assert len(resumes) == kills and all(m.value == m.step for m in resumes)
