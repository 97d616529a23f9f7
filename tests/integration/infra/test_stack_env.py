"""The compose stack's wiring, run for real without containers: a training run with the Ray head's environment
reaches the tracking server started with the compose `mlflow server` command, and both land their files in the
S3 store (moto standing in for MinIO, SQLite for Postgres, loopback ports for the service names). The run is
`jobs.train.run` in this process, as the job driver would call it, to spare a second interpreter start."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import boto3
import pytest
from mlflow import MlflowClient

from mt_ray.config.run import load_run_config
from mt_ray.training.launch import run
from tests.integration.infra.compose import ROOT, load_compose
from tests.integration.infra.mt_ray_env import only_env, use_only_env
from tests.integration.infra.stack import Stack, command_of, env_of
from tests.integration.tracking.servers import free_port, moto_server, running

pytestmark = pytest.mark.slow


def remap(value: str, hosts: Mapping[str, str]) -> str:
    """Service addresses (`minio:9000`) -> where the stand-ins listen (`127.0.0.1:40123`)."""
    for service, local in hosts.items():
        value = value.replace(service, local)
    return value


def mlflow_command(args: list[str], hosts: Mapping[str, str], port: int, db: Path) -> list[str]:
    """The compose command with what a container gave it replaced: address, port, database, one worker."""
    local = {"--host=": "127.0.0.1", "--port=": str(port), "--backend-store-uri=": f"sqlite:///{db}", "--workers=": "1"}
    out = [sys.executable, "-m", "mlflow"]
    for arg in args[1:]:
        prefix = next((p for p in local if arg.startswith(p)), None)
        out.append(prefix + local[prefix] if prefix else remap(arg, hosts))
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("stack")
    services = load_compose(ROOT / "infra" / "compose.yaml")["services"]
    mlflow_name, params = Stack(services).mlflow()
    with moto_server(root) as s3_url:
        hosts = {"minio:9000": s3_url.removeprefix("http://")}
        creator = env_of(services["create-buckets"])
        s3 = boto3.client("s3", endpoint_url=s3_url, region_name="us-east-1", aws_access_key_id=creator["MINIO_ROOT_USER"],
                          aws_secret_access_key=creator["MINIO_ROOT_PASSWORD"])
        for bucket in creator["BUCKETS"].split():  # what the create-buckets service does
            s3.create_bucket(Bucket=bucket)
        port = free_port()
        hosts[f"{mlflow_name}:{params['port']}"] = f"127.0.0.1:{port}"
        cmd = mlflow_command(command_of(services[mlflow_name]), hosts, port, root / "mlflow.db")
        env = only_env({k: remap(v, hosts) for k, v in env_of(services[mlflow_name]).items()})
        with running(cmd, f"http://127.0.0.1:{port}/health", root / "mlflow.log", env=env, timeout_s=120):
            yield {"services": services, "hosts": hosts, "s3": s3, "tracking": f"http://127.0.0.1:{port}", "root": root}


def test_job_with_the_ray_head_env_tracks_and_checkpoints_through_the_stack(stack, monkeypatch):
    use_only_env({k: remap(v, stack["hosts"]) for k, v in env_of(stack["services"]["ray-head"]).items()}, monkeypatch)
    run(load_run_config(None, [
        "training.steps=3", "training.log_every=1", "training.export=false", "training.micro_batch_size=2",
        "training.grad_accum_steps=1", "data.max_seq_len=64", "engine.device=cpu",
        "training.storage=s3://mt-ray/runs", "training.run_name=stack",
        "tracking.experiment=stack"]))

    client = MlflowClient(stack["tracking"])
    [tracked] = client.search_runs([client.get_experiment_by_name("stack").experiment_id])
    assert tracked.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(tracked.info.run_id, "loss")] == [1, 2, 3]
    assert tracked.data.tags["checkpoint.latest"] == "s3://mt-ray/runs/stack/checkpoints/step-00000003"

    s3 = stack["s3"]
    artifacts = {o["Key"].rsplit("/", 1)[-1] for o in s3.list_objects_v2(Bucket="mlflow")["Contents"]}
    assert {"config.json", "summary.json", "loss.png"} <= artifacts  # proxied by the server into the bucket
    stored = {o["Key"] for o in s3.list_objects_v2(Bucket="mt-ray", Prefix="runs/stack/")["Contents"]}
    assert {"runs/stack/checkpoints/step-00000003/manifest.json", "runs/stack/run.json",
            "runs/stack/summary.json"} <= stored
