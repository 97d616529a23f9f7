"""`ray job submit` round trip: a head started here runs `python -m jobs.train` on 2 Ray workers."""

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

from tests.conftest import ROOT

pytest.importorskip("ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The head and every client here share one token, so the test does not depend on ~/.ray.
AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def ray_cli(*args, timeout=120, check=True) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **AUTH}
    cmd = [shutil.which("ray") or "ray", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=check)


@pytest.fixture
def ray_head():
    port, dash = free_port(), free_port()
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's unix socket paths must fit 107 bytes
    started = ray_cli("start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=true",
                      "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--object-store-memory=200000000",
                      f"--temp-dir={temp}", check=False)
    if started.returncode != 0:
        pytest.fail(f"ray start --head failed:\n{started.stdout}\n{started.stderr}")
    try:
        yield f"http://127.0.0.1:{dash}"
    finally:
        ray_cli("stop", "--force", check=False)
        shutil.rmtree(temp, ignore_errors=True)


def test_job_submit_trains_two_steps(ray_head, tmp_path):
    out = tmp_path / "run"
    train = [sys.executable, "-m", "jobs.train", "--config", str(ROOT / "jobs/configs/demo.yaml"), "training.steps=2",
             "data.max_seq_len=64", "engine.device=cpu", "tracking.enabled=false", "cluster.num_workers=2",
             f"training.storage={tmp_path}", "training.run_name=run"]
    env = json.dumps({"env_vars": {"PYTHONPATH": str(ROOT)}})
    submitted = ray_cli("job", "submit", f"--address={ray_head}", "--submission-id=mt-ray-test", "--no-wait",
                        f"--runtime-env-json={env}", "--", *train, check=False)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr

    # Bounded wait: --follow returns when the job ends; the timeout ends a hung one.
    logs = ray_cli("job", "logs", f"--address={ray_head}", "--follow", "mt-ray-test", timeout=240, check=False).stdout
    status = ray_cli("job", "status", f"--address={ray_head}", "mt-ray-test", check=False)
    assert "succeeded" in status.stdout + status.stderr, logs[-3000:] + status.stdout + status.stderr
    assert "done: 2 steps" in logs
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and (out / "hf_model" / "model.safetensors").exists()
