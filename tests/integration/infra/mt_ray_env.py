"""What mt-ray's own clients resolve to in a given environment: the proof that the variables a cluster
definition sets are ones mt-ray (through boto3 and MLflow) actually reads.

mt-ray has no variables of its own: with `checkpoint.endpoint_url`, `checkpoint.region` and
`tracking.tracking_uri` unset it defers to boto3 (`AWS_ENDPOINT_URL_S3`, `AWS_REGION`, the
credential chain) and MLflow (`MLFLOW_TRACKING_URI`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import pytest

from mt_ray.tracking import CheckpointConfig, MlflowTracker, TrackingConfig
from mt_ray.tracking.ckpt_s3 import build_s3_client


@dataclass(frozen=True)
class ResolvedClients:
    s3_endpoint: str
    s3_object_url: str  # where a GET of s3://mt-ray/key goes: path-style, as MinIO without a domain needs
    s3_region: str | None
    access_key: str | None
    tracking_uri: str


# Nothing from this machine (a profile, an instance role) may stand in for what the environment lacks.
NO_AMBIENT_AWS = {"AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
                  "AWS_EC2_METADATA_DISABLED": "true"}


def only_env(env: Mapping[str, str]) -> dict[str, str]:
    """This process's environment with its AWS/MLflow settings replaced by `env`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MLFLOW_"))}
    return {**base, **NO_AMBIENT_AWS, **env}


def use_only_env(env: Mapping[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`only_env` applied to this process (undone by `monkeypatch`)."""
    for key in [k for k in os.environ if k.startswith(("AWS_", "MLFLOW_"))]:
        monkeypatch.delenv(key)
    for key, value in {**NO_AMBIENT_AWS, **env}.items():
        monkeypatch.setenv(key, value)


def resolve_clients(env: Mapping[str, str], monkeypatch: pytest.MonkeyPatch) -> ResolvedClients:
    """Build the clients a default-configured run builds, with `env` as the only AWS/MLflow environment."""
    import boto3

    use_only_env(env, monkeypatch)
    s3 = build_s3_client(CheckpointConfig(uri="s3://bucket/run"))
    credentials = boto3.session.Session().get_credentials()
    tracker = MlflowTracker(TrackingConfig())
    url = s3.generate_presigned_url("get_object", Params={"Bucket": "mt-ray", "Key": "key"})
    return ResolvedClients(s3.meta.endpoint_url, url.split("?")[0], s3.meta.region_name,
                           credentials.access_key if credentials else None, tracker.client.tracking_uri)
