"""`ray job submit` round trip: a head started here runs `python -m jobs.train` on 2 Ray workers."""

import json
import sys

import pytest

from tests.conftest import ROOT

pytest.importorskip("ray")


def test_job_submit_trains_two_steps(ray_head, tmp_path):
    out = tmp_path / "run"
    train = [sys.executable, "-m", "jobs.train", "--config", str(ROOT / "jobs/configs/demo.yaml"), "training.steps=2",
             "data.max_seq_len=64", "engine.device=cpu", "tracking.enabled=false", "cluster.num_workers=2",
             f"training.storage={tmp_path}", "training.run_name=run"]
    ray_head.submit("mt-ray-test", train, {"PYTHONPATH": str(ROOT)})

    # Bounded wait: --follow returns when the job ends; the timeout ends a hung one.
    logs = ray_head.logs("mt-ray-test", follow=True, timeout=240)
    status = ray_head.status("mt-ray-test")
    assert "succeeded" in status, logs[-3000:] + status
    assert "done: 2 steps" in logs
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and (out / "hf_model" / "model.safetensors").exists()
