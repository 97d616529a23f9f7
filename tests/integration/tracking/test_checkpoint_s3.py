"""S3 checkpoints against a real moto server: roundtrip, errors that say what to fix, interrupted uploads."""

from __future__ import annotations

import logging
import time
import uuid

import pytest
import torch
from botocore.exceptions import ResponseStreamingError
from servers import free_port, moto_server

from jobs.train import main
from mt_ray.config.run import load_run_config
from mt_ray.errors import CheckpointError
from mt_ray.tracking.checkpoint import CheckpointConfig, CheckpointManager
from mt_ray.tracking.ckpt_format import ShardSource
from mt_ray.tracking.ckpt_s3 import S3Storage, S3Writer, build_s3_client
from mt_ray.training.run_dir import RunDir

MIB = 1 << 20
SECRET = "testing-secret-key-value"


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    with moto_server(tmp_path_factory.mktemp("moto")) as url:
        yield url


@pytest.fixture
def aws_env(monkeypatch, tmp_path):
    """Credentials from the environment only: no ~/.aws files, no instance metadata lookups."""
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def config(endpoint: str, uri: str, **kw) -> CheckpointConfig:
    base = dict(uri=uri, endpoint_url=endpoint, region="us-east-1", shard_bytes=8 * MIB,
                multipart_threshold_bytes=5 * MIB, multipart_chunk_bytes=5 * MIB, retries=2, retry_backoff_s=0.01)
    return CheckpointConfig(**{**base, **kw})


@pytest.fixture
def bucket(endpoint, aws_env):
    name = f"ckpt-{uuid.uuid4().hex[:10]}"
    client = build_s3_client(config(endpoint, f"s3://{name}"))
    client.create_bucket(Bucket=name)
    return name, client


def state(seed: int) -> tuple[dict[str, torch.Tensor], dict]:
    g = torch.Generator().manual_seed(seed)
    tensors = {"master": torch.randn(3 * MIB, generator=g),  # 12 MiB: two shards, the first a multipart upload
               "exp_avg": torch.randn(1000, generator=g), "rng.cpu": torch.get_rng_state()}
    return tensors, {"step": seed, "data": {"position": [seed, 2 * seed]}}


def keys(client, bucket: str, prefix: str = "") -> list[str]:
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_roundtrip_prune_and_out_buffers(endpoint, bucket):
    name, client = bucket
    ckpt = CheckpointManager(config(endpoint, f"s3://{name}/runs/a", keep_last=2))
    assert ckpt.latest() is None
    for step in (1, 2, 3):
        uri = ckpt.save(step, *state(step))
    assert uri == f"s3://{name}/runs/a/step-00000003" and ckpt.latest() == uri
    assert [c.step for c in ckpt.list()] == [2, 3]
    assert keys(client, name, "runs/a/step-00000001") == []  # pruned
    assert "runs/a/step-00000003/master.00001-of-00002.safetensors" in keys(client, name)
    assert client.list_multipart_uploads(Bucket=name).get("Uploads", []) == []

    tensors, meta = state(3)
    out = {"master": torch.zeros_like(tensors["master"])}
    loaded, loaded_meta = ckpt.load(out=out)
    assert loaded["master"] is out["master"]
    assert_same(loaded, tensors)
    assert loaded_meta == meta
    loaded, loaded_meta = ckpt.load(f"s3://{name}/runs/a/step-00000002")
    assert_same(loaded, state(2)[0])
    assert loaded_meta == state(2)[1]
    with pytest.raises(CheckpointError, match="no checkpoint at s3://.*/step-00000001"):
        ckpt.load(f"s3://{name}/runs/a/step-00000001")


def test_corrupted_object_falls_back(endpoint, bucket, caplog):
    name, client = bucket
    ckpt = CheckpointManager(config(endpoint, f"s3://{name}/run"))
    ckpt.save(1, *state(1))
    ckpt.save(2, *state(2))
    key = "run/step-00000002/exp_avg.00000-of-00001.safetensors"
    raw = bytearray(client.get_object(Bucket=name, Key=key)["Body"].read())
    raw[-1] ^= 0xFF
    client.put_object(Bucket=name, Key=key, Body=bytes(raw))
    with pytest.raises(CheckpointError, match="exp_avg.00000-of-00001.safetensors fails its SHA-256"):
        ckpt.load(f"s3://{name}/run/step-00000002")
    with caplog.at_level(logging.WARNING):
        loaded, meta = ckpt.load()
    assert meta["step"] == 1 and "falling back" in caplog.text


class BrokenUploadWriter(S3Writer):
    """The second shard's upload dies mid-multipart, and the process with it: no abort, no manifest."""

    def write_file(self, source: ShardSource):
        if source.start == 0:
            return super().write_file(source)
        return super().write_file(ShardSourceDyingAfter(source.file, source.name, source.start, source.flat))

    def abort(self) -> None:
        pass


class ShardSourceDyingAfter(ShardSource):
    def blocks(self):
        blocks = super().blocks()
        yield next(blocks)  # header
        yield next(blocks)  # 16 MiB block: three 5 MiB parts go up...
        raise ConnectionResetError("connection lost mid-upload")  # ...then the stream breaks


class BrokenUploadStorage(S3Storage):
    def begin(self, dir_name: str) -> S3Writer:
        super().begin(dir_name)
        return BrokenUploadWriter(self, dir_name)


def test_interrupted_upload_is_never_taken_as_complete(endpoint, bucket):
    name, client = bucket
    cfg = config(endpoint, f"s3://{name}/run", shard_bytes=40 * MIB, io_workers=1)
    ckpt = CheckpointManager(cfg)
    tensors, meta = state(1)
    ckpt.save(1, tensors, meta)
    big = {"master": torch.randn(20 * MIB)}  # 80 MiB: two 40 MiB shards
    broken = CheckpointManager(cfg, storage=BrokenUploadStorage(cfg.uri, cfg))
    with pytest.raises(CheckpointError, match="step-00000002 failed: connection lost mid-upload"):
        broken.save(2, big, {"step": 2})
    left = keys(client, name, "run/step-00000002/")
    assert left == ["run/step-00000002/master.00000-of-00002.safetensors"]  # first shard only, no manifest
    assert client.list_multipart_uploads(Bucket=name).get("Uploads", []) == []  # s3transfer aborted the parts
    assert ckpt.latest() == f"s3://{name}/run/step-00000001"
    loaded, loaded_meta = ckpt.load()
    assert_same(loaded, tensors)
    assert loaded_meta == meta
    ckpt.save(3, *state(3))  # the next save removes the debris
    assert keys(client, name, "run/step-00000002/") == []


class FlakyBody:
    """A download body whose stream breaks after a few bytes, like a dropped connection."""

    def __init__(self, body):
        self.body = body

    def readinto(self, view):
        if len(view) > 8:
            raise ResponseStreamingError(error="connection reset by peer")
        return self.body.readinto(view)

    def read(self, n=-1):
        return self.body.read(n)

    def close(self):
        self.body.close()


class FlakyClient:
    """Delegates to a real client; the first download of each shard breaks mid-stream."""

    def __init__(self, client):
        self.client = client
        self.broken: set[str] = set()

    def __getattr__(self, attr):
        return getattr(self.client, attr)

    def get_object(self, **kw):
        response = self.client.get_object(**kw)
        if kw["Key"].endswith(".safetensors") and kw["Key"] not in self.broken:
            self.broken.add(kw["Key"])
            response["Body"] = FlakyBody(response["Body"])
        return response


def test_broken_download_is_retried(endpoint, bucket, caplog):
    name, client = bucket
    cfg = config(endpoint, f"s3://{name}/run")
    tensors, meta = state(1)
    CheckpointManager(cfg).save(1, tensors, meta)
    flaky = FlakyClient(build_s3_client(cfg))
    with caplog.at_level(logging.WARNING):
        loaded, _ = CheckpointManager(cfg, storage=S3Storage(cfg.uri, cfg, client=flaky)).load()
    assert_same(loaded, tensors)
    assert len(flaky.broken) == 4 and "retry 1 of 1" in caplog.text


def test_missing_bucket(endpoint, aws_env):
    with pytest.raises(CheckpointError, match="bucket 'no-such-bucket' does not exist"):
        CheckpointManager(config(endpoint, "s3://no-such-bucket/run"))


def test_missing_credentials(endpoint, aws_env, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(CheckpointError, match="no usable AWS credentials.*AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        CheckpointManager(config(endpoint, "s3://any/run"))


def test_missing_profile(endpoint, aws_env):
    with pytest.raises(CheckpointError, match="aws_profile"):
        CheckpointManager(config(endpoint, "s3://any/run", aws_profile="nope"))


def test_bad_credentials(tmp_path, aws_env):
    bad_keys = pytest.raises(CheckpointError, match=r"rejected the credentials \(InvalidAccessKeyId\).*AWS_PROFILE")
    # INITIAL_NO_AUTH_ACTION_COUNT=0: moto checks every key against its (empty) IAM
    with moto_server(tmp_path, INITIAL_NO_AUTH_ACTION_COUNT="0") as strict, bad_keys as e:
        CheckpointManager(config(strict, "s3://any/run"))
    assert SECRET not in str(e.value) and "testing" not in str(e.value)


def test_unreachable_endpoint(aws_env):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=f"cannot reach the S3 endpoint {dead}.*endpoint_url"):
        CheckpointManager(config(dead, "s3://any/run", retries=1, connect_timeout_s=2))
    assert time.monotonic() - start < 10


def test_a_run_stored_on_s3_keeps_everything_in_its_folder_there(endpoint, bucket, tmp_path, monkeypatch):
    """run.json, config.yaml, checkpoints, the exported model (staged locally, then uploaded) and summary.json."""
    name, client = bucket
    monkeypatch.chdir(tmp_path)
    args = [f"training.storage=s3://{name}/runs", "training.run_name=r", f"checkpoint.endpoint_url={endpoint}",
            "checkpoint.region=us-east-1", "training.steps=2", "data.max_seq_len=64", "engine.device=cpu",
            "tracking.enabled=false"]
    assert main(args) == 0
    stored = keys(client, name, "runs/r/")
    assert {"runs/r/run.json", "runs/r/config.yaml", "runs/r/summary.json", "runs/r/hf_model/model.safetensors",
            "runs/r/hf_model/config.json", "runs/r/hf_model/tokenizer.json",
            "runs/r/checkpoints/step-00000002/manifest.json"} <= set(stored)
    assert list(tmp_path.iterdir()) == []  # nothing of the run in the working directory

    run = RunDir(load_run_config(None, args))
    assert run.read_summary()["exported_model"] == f"s3://{name}/runs/r/hf_model"
    staging = run.staging
    run.close()
    assert not staging.exists()
