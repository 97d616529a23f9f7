"""infra/k8s: the RayCluster and RayJob are valid KubeRay v1 objects (vendored schema subset), the GPU workers
ask for GPUs, the job targets the cluster and its entrypoint resolves in the image."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import yaml

from tests.integration.infra.breaks import assert_rejects
from tests.integration.infra.clis import ray_start_params
from tests.integration.infra.compose import ROOT
from tests.integration.infra.docker_context import Dockerfile, DockerIgnore
from tests.integration.infra.entrypoints import ModuleCommand, entrypoint_problems
from tests.integration.infra.mt_ray_env import resolve_clients

K8S = ROOT / "infra" / "k8s"
SCHEMA = json.loads((ROOT / "tests" / "fixtures" / "schemas" / "kuberay-v1-subset.json").read_text())
GPU = "nvidia.com/gpu"


@pytest.fixture
def docs() -> dict[str, dict]:
    """Every object of infra/k8s/*.yaml by kind."""
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["kind"] not in out, f"two {doc['kind']} objects"
            out[doc["kind"]] = doc
    return out


def containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def kuberay_problems(docs: dict[str, dict]) -> list[str]:
    validator = jsonschema.Draft7Validator(SCHEMA)
    problems = [f"{kind} {'/'.join(map(str, e.absolute_path))}: {e.message}"
                for kind, doc in docs.items() for e in validator.iter_errors(doc)]
    if problems:
        return problems
    cluster, job = docs["RayCluster"], docs["RayJob"]
    spec = cluster["spec"]
    for group in spec["workerGroupSpecs"]:
        limits = [c.get("resources", {}).get("limits", {}) for c in containers(group)]
        if not any(int(lim.get(GPU, 0)) >= 1 for lim in limits):
            problems.append(f"worker group {group['groupName']!r} has no {GPU} limit")
    names = {docs["ConfigMap"]["metadata"]["name"]} if "ConfigMap" in docs else set()
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        for container in containers(group):
            refs = {e["configMapRef"]["name"] for e in container.get("envFrom", []) if "configMapRef" in e}
            problems += [f"{container['name']}: ConfigMap {r!r} is not defined" for r in refs - names]
    selected = job["spec"].get("clusterSelector", {}).get("ray.io/cluster")
    if selected is not None and selected != cluster["metadata"]["name"]:
        problems.append(f"RayJob selects cluster {selected!r}, the RayCluster is {cluster['metadata']['name']!r}")
    problems += [f"RayJob entrypoint: {p}" for p in entrypoint_problems(job["spec"]["entrypoint"])]
    return problems


def test_manifests_are_valid_and_consistent(docs):
    assert set(docs) == {"ConfigMap", "RayCluster", "RayJob"}
    assert kuberay_problems(docs) == []


def test_cluster_runs_the_pinned_ray(docs):
    pinned = re.search(r"^ray==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M).group(1)
    assert docs["RayCluster"]["spec"]["rayVersion"] == pinned


def test_ray_start_params_are_flags_ray_start_accepts(docs):
    spec = docs["RayCluster"]["spec"]
    head = ray_start_params(["--head", *(f"--{k}={v}" for k, v in spec["headGroupSpec"]["rayStartParams"].items())])
    assert head["num_gpus"] == 0 and head["num_cpus"] == 0 and head["dashboard_host"] == "0.0.0.0"
    for group in spec["workerGroupSpecs"]:
        ray_start_params(["--address=head:6379", *(f"--{k}={v}" for k, v in group["rayStartParams"].items())])


def test_gpu_workers_get_shared_memory_for_the_object_store(docs):
    for group in docs["RayCluster"]["spec"]["workerGroupSpecs"]:
        volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
        mounts = {m["mountPath"]: m["name"] for c in containers(group) for m in c.get("volumeMounts", [])}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


def test_job_config_is_in_the_image_and_runs_on_a_gpu(docs):
    spec = docs["RayJob"]["spec"]
    config = ModuleCommand.parse(spec["entrypoint"]).train_args().config
    df = Dockerfile.parse((ROOT / "infra" / "Dockerfile").read_text())
    assert f"{df.final_workdir()}/{config}" in df.image_files(ROOT, DockerIgnore.for_context(ROOT))
    assert spec["entrypointNumGpus"] >= 1 and spec["shutdownAfterJobFinishes"] is False  # not its cluster


def test_configmap_env_is_what_mt_ray_reads(docs, monkeypatch):
    env = docs["ConfigMap"]["data"]
    secret = {"AWS_ACCESS_KEY_ID": "from-secret", "AWS_SECRET_ACCESS_KEY": "also-from-secret"}
    resolved = resolve_clients({**env, **secret}, monkeypatch)
    assert resolved.s3_endpoint == env["AWS_ENDPOINT_URL_S3"] and resolved.s3_region == env["AWS_REGION"]
    assert resolved.tracking_uri == env["MLFLOW_TRACKING_URI"] and resolved.access_key == "from-secret"


def _workers(d: dict) -> list[dict]:
    return d["RayCluster"]["spec"]["workerGroupSpecs"]


BREAKS = {
    "old apiVersion": (lambda d: d["RayJob"].update(apiVersion="ray.io/v1alpha1"), "'ray.io/v1' was expected"),
    "misspelt field": (lambda d: d["RayCluster"]["spec"].update(workerGroupSpec=[]), "'workerGroupSpec' was unexpected"),
    "no group name": (lambda d: _workers(d)[0].pop("groupName"), "'groupName' is a required property"),
    "bad name": (lambda d: d["RayCluster"]["metadata"].update(name="MT_Ray"), "does not match"),
    "number in ConfigMap": (lambda d: d["ConfigMap"]["data"].update(PORT=5000), "5000 is not of type 'string'"),
    "cluster and selector": (lambda d: d["RayJob"]["spec"].update(rayClusterSpec=d["RayCluster"]["spec"]),
                             "should not be valid under {'required': ['rayClusterSpec', 'clusterSelector']}"),
    "no GPU": (lambda d: containers(_workers(d)[0])[0]["resources"]["limits"].pop(GPU), "has no nvidia.com/gpu limit"),
    "other cluster": (lambda d: d["RayJob"]["spec"]["clusterSelector"].update({"ray.io/cluster": "raycluster"}),
                      "RayJob selects cluster 'raycluster'"),
    "missing ConfigMap": (lambda d: d["ConfigMap"]["metadata"].update(name="env"), "ConfigMap 'mt-ray-env' is not"),
    "missing config": (lambda d: d["RayJob"]["spec"].update(entrypoint="python -m jobs.train --config jobs/x.yaml"),
                       "config 'jobs/x.yaml' does not exist"),
    "bad override": (lambda d: d["RayJob"]["spec"].update(entrypoint="python -m jobs.train training.steps=zero"),
                     "training.steps"),
}


@pytest.mark.parametrize("name", BREAKS)
def test_checks_reject_a_broken_copy(docs, name):
    mutate, expected = BREAKS[name]
    assert_rejects(docs, mutate, expected, kuberay_problems)
