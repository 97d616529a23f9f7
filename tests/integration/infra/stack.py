"""The wiring of the compose stack: every address, bucket and credential one service uses is one that
another service actually provides.

Services are found by what they run, not by name: the Ray head and workers by their `ray start`
command (parsed by Ray's own CLI), the tracking server by `mlflow server` (parsed by MLflow's),
Postgres, MinIO and the bucket creator by their images. `wiring_problems` lists each broken link.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from tests.integration.infra.clis import mlflow_server_params, ray_start_params
from tests.integration.infra.compose import depends_on
from tests.integration.infra.shell import program_args

POSTGRES_PORT = 5432  # the postgres image's listening port; it is not configurable through its environment


def env_of(service: Mapping[str, Any]) -> dict[str, str]:
    """`environment` in either syntax (map or list of KEY=VALUE), values as strings."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def command_of(service: Mapping[str, Any]) -> str | list[str]:
    command = service.get("command") or []
    return [str(c) for c in command] if isinstance(command, list) else command


@dataclass
class Stack:
    """The services of one compose file, by role."""

    services: Mapping[str, Any]

    def by_image(self, prefix: str) -> str:
        names = [n for n, s in self.services.items() if str(s.get("image", "")).startswith(prefix)]
        if len(names) != 1:
            raise LookupError(f"expected one service running an image {prefix}*, found {names}")
        return names[0]

    def ray_nodes(self) -> dict[str, dict[str, Any]]:
        nodes = {}
        for name, service in self.services.items():
            args = program_args(command_of(service), "ray", "start")
            if args is not None:
                nodes[name] = ray_start_params(args)
        return nodes

    def mlflow(self) -> tuple[str, dict[str, Any]]:
        found = [(n, program_args(command_of(s), "mlflow", "server")) for n, s in self.services.items()]
        found = [(n, mlflow_server_params(args)) for n, args in found if args is not None]
        if len(found) != 1:
            raise LookupError(f"expected one service running `mlflow server`, found {[n for n, _ in found]}")
        return found[0]

    def minio_url(self) -> str:
        name = self.by_image("minio/minio")
        args = program_args(command_of(self.services[name]), "server") or []
        address = next((a.split("=", 1)[1] for a in args if a.startswith("--address=")), ":9000")
        return f"http://{name}:{address.rsplit(':', 1)[1]}"


def wiring_problems(services: Mapping[str, Any]) -> list[str]:
    stack = Stack(services)
    return ray_problems(stack) + mlflow_problems(stack) + client_problems(stack)


def ray_problems(stack: Stack) -> list[str]:
    nodes = stack.ray_nodes()
    heads = [n for n, p in nodes.items() if p["head"]]
    if len(heads) != 1:
        return [f"expected one Ray head, found {heads}"]
    head, problems = heads[0], []
    workers = [n for n in nodes if n != head]
    if not workers:
        problems.append("no Ray worker joins the head")
    for worker in workers:
        expected = f"{head}:{nodes[head]['port']}"
        if nodes[worker]["address"] != expected:
            problems.append(f"{worker}: joins {nodes[worker]['address']!r}, the head listens at {expected!r}")
        problems += _waits_for(stack, worker, head, "service_healthy")
    return problems


def mlflow_problems(stack: Stack) -> list[str]:
    """The tracking server's database is the Postgres service, its artifact bucket one the creator makes."""
    name, params = stack.mlflow()
    postgres = stack.by_image("postgres")
    pg_env = env_of(stack.services[postgres])
    db = urlsplit(params["backend_store_uri"])
    problems = []
    expected = (postgres, POSTGRES_PORT, pg_env.get("POSTGRES_USER"), pg_env.get("POSTGRES_PASSWORD"),
                pg_env.get("POSTGRES_DB"))
    found = (db.hostname, db.port, db.username, db.password, db.path.lstrip("/"))
    if not db.scheme.startswith("postgresql") or found != expected:
        problems.append(f"{name}: backend store {params['backend_store_uri']!r} is not the {postgres!r} database")
    problems += _waits_for(stack, name, postgres, "service_healthy")

    creator = stack.by_image("minio/mc")
    artifacts = urlsplit(params["artifacts_destination"])
    if artifacts.scheme != "s3" or artifacts.hostname not in env_of(stack.services[creator]).get("BUCKETS", "").split():
        problems.append(f"{name}: artifact store {params['artifacts_destination']!r} is not a bucket {creator} creates")
    problems += _waits_for(stack, name, creator, "service_completed_successfully")
    problems += _s3_client_problems(stack, name, "MLFLOW_S3_ENDPOINT_URL")
    problems += _s3_client_problems(stack, creator, "S3_ENDPOINT", key_id="MINIO_ROOT_USER",
                                    secret="MINIO_ROOT_PASSWORD")
    problems += _waits_for(stack, creator, stack.by_image("minio/minio"), "service_healthy")
    return problems


def client_problems(stack: Stack) -> list[str]:
    """Every Ray node reaches the tracking server (by an allowed Host) and the S3 store with valid keys."""
    from mlflow.server.security_utils import is_allowed_host_header

    mlflow, params = stack.mlflow()
    allowed = (params["allowed_hosts"] or "").split(",")
    problems = []
    for node in stack.ray_nodes():
        uri = urlsplit(env_of(stack.services[node]).get("MLFLOW_TRACKING_URI", ""))
        if (uri.hostname, uri.port) != (mlflow, params["port"]):
            problems.append(f"{node}: MLFLOW_TRACKING_URI {uri.geturl()!r} is not {mlflow}:{params['port']}")
        elif allowed != [""] and not is_allowed_host_header(allowed, uri.netloc):
            problems.append(f"{node}: {mlflow} refuses the Host header {uri.netloc!r} (--allowed-hosts)")
        problems += _s3_client_problems(stack, node, "AWS_ENDPOINT_URL_S3")
    return problems


def _s3_client_problems(stack: Stack, name: str, endpoint_var: str, key_id: str = "AWS_ACCESS_KEY_ID",
                        secret: str = "AWS_SECRET_ACCESS_KEY") -> list[str]:
    env = env_of(stack.services[name])
    minio_env = env_of(stack.services[stack.by_image("minio/minio")])
    problems = []
    if env.get(endpoint_var) != stack.minio_url():
        problems.append(f"{name}: {endpoint_var}={env.get(endpoint_var)!r}, MinIO listens at {stack.minio_url()!r}")
    if (env.get(key_id), env.get(secret)) != (minio_env["MINIO_ROOT_USER"], minio_env["MINIO_ROOT_PASSWORD"]):
        problems.append(f"{name}: {key_id}/{secret} are not MinIO's credentials")
    return problems


def _waits_for(stack: Stack, name: str, dep: str, condition: str) -> list[str]:
    found = depends_on(stack.services[name]).get(dep)
    if found != condition:
        return [f"{name}: should wait for {dep} ({condition}), waits for {found or 'nothing'}"]
    return []
