"""infra/compose.yaml: valid compose-spec, every image pinned or buildable, the stack wired together, and
the variables it sets are the ones mt-ray's clients read. Each check is shown to reject a broken copy."""

from __future__ import annotations

import copy
from collections.abc import Callable

import click
import pytest

from tests.integration.infra.breaks import assert_rejects
from tests.integration.infra.compose import (
    ROOT,
    UndefinedVariableError,
    compose_problems,
    load_compose,
    merge,
    schema_problems,
)
from tests.integration.infra.docker_context import context_problems
from tests.integration.infra.mt_ray_env import resolve_clients
from tests.integration.infra.stack import Stack, env_of, wiring_problems

COMPOSE = ROOT / "infra" / "compose.yaml"
GPU_OVERRIDE = ROOT / "infra" / "compose.gpu.yaml"

Doc = dict


@pytest.fixture
def compose() -> Doc:
    return load_compose(COMPOSE)


def test_compose_file_is_sound(compose):
    assert compose_problems(compose, COMPOSE.parent) == []


def test_stack_is_wired(compose):
    assert wiring_problems(compose["services"]) == []


def test_every_variable_has_a_default_and_an_override_reaches_every_user(tmp_path):
    load_compose(COMPOSE, env={})  # raises UndefinedVariableError for a ${VAR} without default
    doc = load_compose(COMPOSE, env={"MINIO_ROOT_PASSWORD": "from-dot-env", "POSTGRES_PASSWORD": "pg-secret"})
    assert wiring_problems(doc["services"]) == []
    users = [n for n, s in doc["services"].items() if "from-dot-env" in env_of(s).values()]
    assert set(users) == {"minio", "create-buckets", "mlflow", "ray-head", "ray-worker"}
    no_default = tmp_path / "compose.yaml"
    no_default.write_text(COMPOSE.read_text().replace("${MINIO_ROOT_USER:-mtray}", "${MINIO_ROOT_USER}"))
    with pytest.raises(UndefinedVariableError, match="MINIO_ROOT_USER"):
        load_compose(no_default)


def test_builds_are_complete_in_their_context(compose):
    builds = [s["build"] for s in compose["services"].values() if "build" in s]
    assert {b["dockerfile"] for b in builds} == {"infra/Dockerfile", "infra/mlflow.Dockerfile"}
    for build in builds:
        context = (COMPOSE.parent / build["context"]).resolve()
        assert context == ROOT
        assert context_problems(context / build["dockerfile"], context) == []


def test_gpu_override_gives_the_worker_the_gpus(compose):
    override = load_compose(GPU_OVERRIDE)
    assert schema_problems(override) == []
    merged = merge(compose, override)
    assert compose_problems(merged, COMPOSE.parent) == [] and wiring_problems(merged["services"]) == []
    devices = merged["services"]["ray-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert merged["services"]["ray-worker"]["command"] == compose["services"]["ray-worker"]["command"]


def test_ray_nodes_env_is_what_mt_ray_reads(compose, monkeypatch):
    stack = Stack(compose["services"])
    minio = env_of(compose["services"]["minio"])
    for node in stack.ray_nodes():
        resolved = resolve_clients(env_of(compose["services"][node]), monkeypatch)
        assert resolved.s3_endpoint == stack.minio_url() == "http://minio:9000"
        assert resolved.s3_object_url == "http://minio:9000/mt-ray/key"
        assert resolved.s3_region == "us-east-1" and resolved.access_key == minio["MINIO_ROOT_USER"]
        assert resolved.tracking_uri == "http://mlflow:5000"
        monkeypatch.undo()


def _set_arg(service: str, prefix: str, value: str) -> Callable[[Doc], None]:
    """Replace the command argument of `service` that starts with `prefix`."""

    def mutate(doc: Doc) -> None:
        command = doc["services"][service]["command"]
        command[next(i for i, a in enumerate(command) if a.startswith(prefix))] = value

    return mutate


def _svc(doc: Doc, name: str) -> dict:
    return doc["services"][name]


COMPOSE_BREAKS = {
    "unknown key": (lambda d: _svc(d, "postgres").update(helthcheck={}), "'helthcheck' does not match"),
    "bad condition": (lambda d: _svc(d, "mlflow")["depends_on"]["postgres"].update(condition="healthy"),
                      "is not valid under any of the given schemas"),
    "health without healthcheck": (lambda d: _svc(d, "postgres").pop("healthcheck"), "has no healthcheck"),
    "one-shot that restarts": (lambda d: _svc(d, "create-buckets").update(restart="always"), "restarts 'always'"),
    "unknown dependency": (lambda d: _svc(d, "mlflow")["depends_on"].update(db={"condition": "service_started"}),
                           "unknown service 'db'"),
    "cycle": (lambda d: _svc(d, "postgres").update(depends_on=["ray-worker"]), "dependency cycle"),
    "port twice": (lambda d: _svc(d, "minio")["ports"].append("5000:5001"), "host port 5000/tcp"),
    "unpinned image": (lambda d: _svc(d, "postgres").update(image="postgres"), "not pinned"),
    "bad image": (lambda d: _svc(d, "postgres").update(image="Postgres:17"), "not a valid reference"),
    "missing Dockerfile": (lambda d: _svc(d, "mlflow")["build"].update(dockerfile="infra/nope.Dockerfile"),
                           "does not exist"),
}


@pytest.mark.parametrize("name", COMPOSE_BREAKS)
def test_compose_checks_reject_a_broken_copy(compose, name):
    mutate, expected = COMPOSE_BREAKS[name]
    assert_rejects(compose, mutate, expected, lambda d: compose_problems(d, COMPOSE.parent))


WIRING_BREAKS = {
    "worker joins the wrong port": (_set_arg("ray-worker", "--address=", "--address=ray-head:6380"),
                                    "the head listens at 'ray-head:6379'"),
    "head on another port": (_set_arg("ray-head", "--port=", "--port=6380"), "the head listens at 'ray-head:6380'"),
    "tracking URI to nowhere": (lambda d: _svc(d, "ray-worker")["environment"].update(
        MLFLOW_TRACKING_URI="http://tracking:5000"), "is not mlflow:5000"),
    "Host header refused": (_set_arg("mlflow", "--allowed-hosts=", "--allowed-hosts=localhost:*"),
                            "refuses the Host header 'mlflow:5000'"),
    "other database": (_set_arg("mlflow", "--backend-store-uri=",
                                "--backend-store-uri=postgresql://mlflow:mlflow-dev-secret@postgres:5432/runs"),
                       "is not the 'postgres' database"),
    "bucket never created": (lambda d: _svc(d, "create-buckets")["environment"].update(BUCKETS="mt-ray"),
                             "is not a bucket create-buckets creates"),
    "wrong S3 endpoint": (lambda d: _svc(d, "ray-head")["environment"].update(AWS_ENDPOINT_URL_S3="http://minio:9001"),
                          "MinIO listens at 'http://minio:9000'"),
    "wrong secret": (lambda d: _svc(d, "mlflow")["environment"].update(AWS_SECRET_ACCESS_KEY="x"),
                     "are not MinIO's credentials"),
    "no wait for buckets": (lambda d: _svc(d, "mlflow")["depends_on"].pop("create-buckets"),
                            "should wait for create-buckets"),
}


@pytest.mark.parametrize("name", WIRING_BREAKS)
def test_wiring_checks_reject_a_broken_copy(compose, name):
    mutate, expected = WIRING_BREAKS[name]
    assert_rejects(compose, mutate, expected, lambda d: wiring_problems(d["services"]))


@pytest.mark.parametrize("service, prefix, bad", [("mlflow", "--workers=", "--wrokers=2"),
                                                  ("ray-head", "--port=", "--port=http"),
                                                  ("ray-worker", "--block", "--blok")])
def test_commands_are_parsed_by_the_real_cli(compose, service, prefix, bad):
    broken = copy.deepcopy(compose)
    _set_arg(service, prefix, bad)(broken)
    with pytest.raises(click.UsageError):
        wiring_problems(broken["services"])
