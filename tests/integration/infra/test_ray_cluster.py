"""infra/ray/cluster.yaml passes what `ray up` checks before it touches the cloud (the schema shipped with the
installed Ray, then Ray's own config preparation and validation), and its start commands fit together."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from urllib.parse import urlsplit

import click
import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from tests.integration.infra.breaks import assert_rejects
from tests.integration.infra.clis import mlflow_server_params, ray_start_params
from tests.integration.infra.compose import ROOT
from tests.integration.infra.shell import find_command

CLUSTER = ROOT / "infra" / "ray" / "cluster.yaml"
RAY_SCHEMA = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"


@pytest.fixture
def cluster() -> dict:
    return yaml.safe_load(CLUSTER.read_text())


def cluster_problems(config: dict) -> list[str]:
    """Schema errors, then what Ray's `prepare_config` + `validate_config` (the start of `ray up`) reject."""
    validator = jsonschema.Draft7Validator(json.loads(RAY_SCHEMA.read_text()))
    problems = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(config)]
    if not problems:
        try:
            validate_config(prepare_config(copy.deepcopy(config)))
        except (ValueError, jsonschema.ValidationError) as e:
            problems.append(str(e).splitlines()[0])
    return problems


def start_command(lines: list[str], *program: str):
    found = [c for c in (find_command(line, *program) for line in lines) if c is not None]
    assert len(found) == 1, f"expected one `{' '.join(program)}` in {lines}"
    return found[0]


def test_cluster_config_passes_ray_up_validation(cluster):
    assert cluster_problems(cluster) == []


def test_node_types_head_schedules_nothing_and_workers_have_gpus(cluster):
    types = cluster["available_node_types"]
    assert types[cluster["head_node_type"]]["resources"] == {"CPU": 0, "GPU": 0}
    workers = {name: t for name, t in types.items() if name != cluster["head_node_type"]}
    assert workers and all(t["resources"]["GPU"] >= 1 for t in workers.values())
    assert all("IamInstanceProfile" in t["node_config"] for t in workers.values())  # S3 checkpoints


def test_workers_join_the_head_and_find_its_tracking_server(cluster):
    head = start_command(cluster["head_start_ray_commands"], "ray", "start")
    worker = start_command(cluster["worker_start_ray_commands"], "ray", "start")
    mlflow = mlflow_server_params(start_command(cluster["head_start_ray_commands"], "mlflow", "server").argv[2:])
    head_params, worker_params = ray_start_params(head.argv[2:]), ray_start_params(worker.argv[2:])
    assert head_params["head"] and worker_params["address"] == f"$RAY_HEAD_IP:{head_params['port']}"
    assert head_params["autoscaling_config"] == "~/ray_bootstrap_config.yaml"  # where `ray up` puts it
    assert urlsplit(head.env["MLFLOW_TRACKING_URI"]).port == mlflow["port"]
    assert worker.env["MLFLOW_TRACKING_URI"] == f"http://$RAY_HEAD_IP:{mlflow['port']}"


def test_nodes_install_nothing_the_image_lacks(cluster):
    assert cluster["setup_commands"] == cluster["head_setup_commands"] == cluster["worker_setup_commands"] == []


BREAKS = {
    "unknown key": (lambda c: c.update(worker_nodes_count=2), "Additional properties are not allowed"),
    "negative GPUs": (lambda c: c["available_node_types"]["gpu-1x-l40s"]["resources"].update(GPU=-1),
                      "-1 is less than the minimum of 0"),
    "unknown head type": (lambda c: c.update(head_node_type="ray.head.default"),
                          "`head_node_type` must be one of `available_node_types`"),
    "min above max": (lambda c: c["available_node_types"]["gpu-1x-l40s"].update(min_workers=5),
                      "smaller than the sum of `min_workers`"),
}


@pytest.mark.parametrize("name", BREAKS)
def test_validation_rejects_a_broken_copy(cluster, name):
    mutate, expected = BREAKS[name]
    assert_rejects(cluster, mutate, expected, cluster_problems)


def test_start_commands_are_parsed_by_the_real_cli(cluster):
    line = cluster["worker_start_ray_commands"][-1].replace("--object-manager-port", "--object-manager-prot")
    with pytest.raises(click.UsageError):
        ray_start_params(start_command([line], "ray", "start").argv[2:])
