"""A sweep's storage on S3 (a moto server): checked writable, its record and best config written and read back."""

from __future__ import annotations

import uuid

import pytest
from servers import moto_server

from mt_ray.errors import ConfigError
from mt_ray.tracking.checkpoint import CheckpointConfig
from mt_ray.tracking.ckpt_s3 import build_s3_client

pytest.importorskip("ray")

from mt_ray.training.sweep_storage import SweepStorage  # noqa: E402


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    with moto_server(tmp_path_factory.mktemp("moto")) as url:
        yield url


@pytest.fixture
def checkpoint(endpoint, monkeypatch, tmp_path) -> CheckpointConfig:
    """The checkpoint store's settings (the sweep's storage uses them), credentials from the environment only."""
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return CheckpointConfig(uri="s3://unused", endpoint_url=endpoint, region="us-east-1")


def test_sweep_state_roundtrips_on_s3(checkpoint):
    bucket = f"sweeps-{uuid.uuid4().hex[:10]}"
    client = build_s3_client(checkpoint)
    client.create_bucket(Bucket=bucket)
    storage = SweepStorage(f"s3://{bucket}/team", "lr", checkpoint)
    assert storage.uri == f"s3://{bucket}/team/lr" and storage.tune_storage_path == f"{bucket}/team"
    assert storage.trials_uri == f"s3://{bucket}/team/lr/trials"
    assert storage.read_record() is None
    storage.write_record({"run_id": "abc", "space": ["loguniform(1e-05, 0.001)"]})
    assert storage.read_record() == {"run_id": "abc", "space": ["loguniform(1e-05, 0.001)"]}
    assert storage.write("best_config.yaml", "optimizer:\n  lr: 0.001\n") == f"s3://{bucket}/team/lr/best_config.yaml"
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]}
    assert keys == {"team/lr/.mt-ray-sweep", "team/lr/sweep.json", "team/lr/best_config.yaml"}


def test_a_bucket_that_cannot_be_written_is_refused_with_the_fix(checkpoint):
    with pytest.raises(ConfigError, match=r"sweep storage s3://no-such-bucket-[0-9a-f]+/lr is not writable \(.*bucket "
                                          r".*does not exist.*\); pass a --storage folder you can write to"):
        SweepStorage(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}", "lr", checkpoint)
