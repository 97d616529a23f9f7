"""Where a run's actors may go: Ray started or joined, each node's resources and host memory checked against
what its bundle of the placement group asks, before anything waits on them."""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray

from mt_ray.cluster.config import ClusterConfig
from mt_ray.cluster.sizing import GIB, ClusterSizing
from mt_ray.cluster.store_settings import SYSTEM_CONFIG
from mt_ray.engine.config import EngineConfig
from mt_ray.errors import ConfigError, InsufficientMemoryError
from mt_ray.verbosity import library_log_level

MIN_STORE = 256 << 20  # the object store of a Ray the driver starts: at least this (Ray's own minimum is 75 MiB)


def check_plan(sizing: ClusterSizing, cfg: EngineConfig, num_workers: int) -> None:
    """Refuse, before anything starts, a plan that a node's configured host memory cannot hold."""
    limit = cfg.host_memory_limit_gb
    if limit is None or sizing.node_host_bytes <= limit * GIB:
        return
    fix = "raise engine.host_memory_limit_gb if the hosts have more"
    if sizing.num_nodes < num_workers:
        fix = f"spread the state over more nodes (cluster.num_nodes, a divisor of {num_workers} workers), or " + fix
    raise InsufficientMemoryError(
        f"each node needs {sizing.node_host_bytes / GIB:.1f} GiB of host memory "
        f"({sizing.node_host_bytes_per_param:.1f} B/param with cluster.num_nodes={sizing.num_nodes}: fp32 state "
        f"{sizing.state_bytes / GIB:.1f} GiB, object store {sizing.object_store_bytes / GIB:.1f} GiB) but "
        f"engine.host_memory_limit_gb is {limit:g}; {fix}")


def init_ray(cfg: ClusterConfig, object_store_bytes: int) -> bool:
    """Join the configured cluster, 'auto' under RAY_ADDRESS, else start a Ray of our own here (never a Ray
    left running on this machine, which `ray.init()` alone would join). True if we started or joined it."""
    if ray.is_initialized():
        return False
    address = cfg.address or ("auto" if os.environ.get("RAY_ADDRESS") else None)
    if address is not None:
        ray.init(address=address, logging_level=library_log_level())
        return True
    store = int(cfg.object_store_memory_gb * GIB) if cfg.object_store_memory_gb else max(object_store_bytes, MIN_STORE)
    ray.init(address="local", num_cpus=cfg.num_cpus, object_store_memory=store, include_dashboard=False,
             _system_config=SYSTEM_CONFIG, logging_level=library_log_level())
    return True


def check_nodes(nodes: list[dict], bundle: dict[str, float], num_nodes: int, cluster: ClusterConfig) -> None:
    """Refuse, before a placement group waits for them, nodes that cannot host a bundle each: names the key."""
    offers = [{k: n["Resources"].get(k, 0) for k in bundle} for n in nodes if n.get("Alive")]
    fit = [o for o in offers if all(o[k] >= v for k, v in bundle.items())]
    if len(fit) >= num_nodes:
        return
    keys = {"CPU": "cluster.cpus_per_worker", "GPU": "cluster.gpus_per_worker"}
    short = [k for k, v in bundle.items() if sum(o[k] >= v for o in offers) < num_nodes]
    key = keys[short[0]] if short else "cluster.num_nodes"
    raise ConfigError(
        f"cluster.num_nodes={num_nodes} node(s) must each host {bundle} for their workers, but only {len(fit)} of "
        f"the cluster's nodes can ({offers}); lower {key} (now {getattr(cluster, key.split('.')[1], num_nodes)}), "
        "or start nodes with more (ray start --num-cpus / --num-gpus)")


@dataclass(frozen=True)
class RolloutPlace:
    """Where GRPO's rollout replicas sit. `shared` (the default): one beside each worker, on its node and its GPU
    (on CPU workers, its CPUs), each generating a share of the prompts; it runs within its worker's reservation,
    on the GPU Ray gave the worker (`worker_devices`), because fractional GPUs would not say which of a node's GPUs
    a half lands on. Else one replica with `gpus` of its own, added to node 0's bundle (`cluster.rollout_gpus`,
    VERL's split layout)."""

    gpus: float  # what each replica reserves from Ray
    shared: bool

    @classmethod
    def resolve(cls, stage: str, configured: float | None) -> RolloutPlace | None:
        """None unless the stage samples its completions (grpo)."""
        if stage != "grpo":
            return None
        return cls(0.0, True) if configured is None else cls(configured, False)

    def beside(self, num_workers: int) -> list[int]:
        """The worker each replica runs beside (node 0's first, for one with GPUs of its own)."""
        return list(range(num_workers)) if self.shared else [0]

    @property
    def own_gpus(self) -> float:
        """GPUs the rollout adds to the run's reservation (none where the replicas share the workers')."""
        return 0.0 if self.shared else self.gpus


def worker_devices(_worker) -> str | None:
    """Run in a worker (`actor.__ray_call__`): the CUDA devices Ray gave its process, which its replica takes."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")
