"""The run's actors and where they sit: the placement group (one bundle per node), each node's coordinator shard,
the engine workers beside it, each node's process group under `grad_reduce: nccl`, and GRPO's rollout replicas'
seats beside the workers (`RolloutHost`, their public interface to the cluster).

`ClusterActors` owns the handles and places every actor; it decides nothing about steps or failures (the driver,
mt_ray.cluster.driver, and its recovery policy, mt_ray.cluster.recovery, do).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mt_ray.cluster.arena import ArenaHandle
from mt_ray.cluster.config import ClusterConfig
from mt_ray.cluster.errors import ClusterError
from mt_ray.cluster.placement import RolloutPlace, check_nodes, worker_devices
from mt_ray.cluster.rollout_host import ReplicaSeat, WeightsVersion
from mt_ray.cluster.run_spec import NodePlan, RolloutBeside, RunSpec
from mt_ray.cluster.shard import CoordinatorShard
from mt_ray.cluster.sizing import GIB, ClusterSizing
from mt_ray.cluster.worker import EngineWorker
from mt_ray.errors import ConfigError


@dataclass(frozen=True)
class Reservation:
    """What the run asks of the cluster: each worker's GPUs and CPUs, and GRPO's rollout placement."""

    num_workers: int
    gpus_per_worker: float
    rollout: RolloutPlace | None


def resolve_gpus_per_worker(cluster: ClusterConfig) -> float:
    """The configured GPUs per worker, else one when the cluster has GPUs (decided once per run)."""
    gpus = cluster.gpus_per_worker
    if gpus is None:
        gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    return gpus


def check_cluster_resources(cluster: ClusterConfig, want: Reservation, sizing: ClusterSizing) -> None:
    """Refuse a run the cluster cannot place: more GPU workers than GPUs, an object store too small."""
    have = ray.cluster_resources()
    own = want.rollout.own_gpus if want.rollout else 0.0
    need = want.num_workers * want.gpus_per_worker + own
    if need and need > have.get("GPU", 0):
        rollout = f" and a rollout actor of {own:g} (cluster.rollout_gpus)" if own else ""
        raise ConfigError(f"cluster.num_workers={want.num_workers} workers of {want.gpus_per_worker:g} GPU each"
                          f"{rollout} need {need:g} GPUs; the cluster has {have.get('GPU', 0):g}. Lower "
                          "cluster.num_workers or add GPU nodes")
    stores = sorted(n["Resources"].get("object_store_memory", 0) for n in ray.nodes() if n["Alive"])
    need = sizing.object_store_bytes
    usable = stores[-cluster.num_nodes:] if len(stores) >= cluster.num_nodes else []
    if not usable or min(usable) < need:
        raise ConfigError(
            f"each of the cluster.num_nodes={cluster.num_nodes} nodes needs a {need / GIB:.2f} GiB object "
            f"store (batches, and unit-sized transfers between nodes); the cluster's are "
            f"{[round(b / GIB, 2) for b in stores]} GiB. Start Ray with a larger --object-store-memory (or "
            "cluster.object_store_memory_gb in-process), or spread the state over more nodes")


class ClusterActors:
    """The placement group, the shards (one per node, by node) and the workers (by rank) of one run."""

    def __init__(self, run: RunSpec, nodes: list[NodePlan], cluster: ClusterConfig, want: Reservation):
        self.run = run
        self.nodes = nodes
        self.cluster = cluster
        self.want = want
        self.placement: PlacementGroup | None = None
        self.shards: list = []
        self.workers: list = []
        self.arenas: list[ArenaHandle] = []
        self.rollout_beside: RolloutBeside | None = None  # GRPO's plan of what shares each worker's GPU

    @property
    def workers_per_node(self) -> int:
        return self.nodes[0].workers

    @property
    def grouped(self) -> bool:
        """Whether each node's workers sum gradients between them in a process group (`grad_reduce: nccl`)."""
        return self.nodes[0].landers != self.workers_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.workers_per_node

    # ------------------------------------------------------------------ placement

    def place(self) -> None:
        """One bundle per node holding its workers (STRICT_SPREAD); the node's shard joins its bundle."""
        per, n = self.workers_per_node, self.cluster.num_nodes
        bundle = {k: v * per for k, v in (("CPU", self.cluster.cpus_per_worker), ("GPU", self.want.gpus_per_worker))
                  if v}
        if not bundle:
            if n > 1:
                raise ConfigError("workers spread over nodes must reserve something there: set cluster.cpus_per_worker > 0")
            return
        check_nodes(ray.nodes(), bundle, n, self.cluster)
        bundles = [dict(bundle) for _ in range(n)]
        rollout = self.want.rollout
        if rollout and rollout.own_gpus:  # the rollout actor's own GPUs, beside node 0's workers
            bundles[0]["GPU"] = bundles[0].get("GPU", 0) + rollout.own_gpus
        pg = placement_group(bundles, strategy="STRICT_SPREAD" if n > 1 else "STRICT_PACK", name="mt-ray-nodes")
        ready, _ = ray.wait([pg.ready()], timeout=self.cluster.placement_timeout_s)
        if not ready:
            remove_placement_group(pg)
            raise ClusterError(f"the cluster did not offer {n} separate nodes with {bundle} each within "
                               f"{self.cluster.placement_timeout_s:.0f} s; add nodes, or lower cluster.num_nodes or "
                               "cluster.num_workers")
        self.placement = pg

    def on_node(self, node: int) -> dict:
        """Actor options that pin an actor to `node`'s bundle."""
        if self.placement is None:
            return {}
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=node)}

    def rollout_options(self, worker: int) -> dict:
        """Ray actor options that place a GRPO rollout replica in worker `worker`'s node bundle (`RolloutPlace`)."""
        return {"num_gpus": self.want.rollout.gpus, "num_cpus": 0, "max_restarts": 0,
                **self.on_node(self.node_of(worker))}

    # ------------------------------------------------------------------ actors

    def build_shards(self) -> list:
        """Start one coordinator shard per node, each told of the others (partial sums go to their unit's owner)."""
        cls = ray.remote(CoordinatorShard)
        n, workers = self.cluster.num_nodes, self.want.num_workers
        concurrency = 16 + 2 * workers + 4 * self.workers_per_node + 4 * n
        self.shards = [cls.options(num_cpus=self.cluster.coordinator_cpus, max_restarts=0, max_concurrency=concurrency,
                                   **self.on_node(plan.node)).remote(self.run, plan, self.cluster.snapshot_every)
                       for plan in self.nodes]
        return self.shards

    def build_workers(self, generation: int, start_step: int, ranks: list[int] | None = None) -> dict[int, object]:
        """Start workers `ranks` (default: all), serving `generation` from `start_step` (a worker started after
        GRPO's plan of its GPU plans the same)."""
        cls = ray.remote(EngineWorker)
        ranks = range(self.want.num_workers) if ranks is None else ranks
        workers = {}
        for r in ranks:
            node = self.node_of(r)
            workers[r] = cls.options(num_gpus=self.want.gpus_per_worker, num_cpus=self.cluster.cpus_per_worker,
                                     max_restarts=0, **self.on_node(node)).remote(
                self.run, self.nodes[node], self.arenas[node], self.shards[node], r, generation, start_step,
                self.cluster.placement_timeout_s, self.rollout_beside)
        return workers

    def form_groups(self) -> None:
        """With `grad_reduce: nccl`, each node's workers form one process group (rank 0's node address); bounded
        by `cluster.placement_timeout_s`, naming the node that did not form."""
        if not self.grouped:
            return
        per, timeout = self.workers_per_node, self.cluster.placement_timeout_s
        calls, nodes = [], []
        for node in range(self.cluster.num_nodes):
            ranks = range(node * per, (node + 1) * per)
            address, port = ray.get(self.workers[ranks[0]].rendezvous.remote(), timeout=timeout)
            calls += [self.workers[r].join_group.remote(address, port, i, per, timeout) for i, r in enumerate(ranks)]
            nodes += [node] * per
        _, late = ray.wait(calls, num_returns=len(calls), timeout=timeout)
        if late:
            raise ClusterError(f"node(s) {sorted({nodes[calls.index(c)] for c in late})} did not form their process "
                               f"group (cluster.grad_reduce: nccl) within cluster.placement_timeout_s={timeout:g} s")
        ray.get(calls)

    def kill_workers(self, ranks: list[int]) -> None:
        for r in ranks:
            ray.kill(self.workers[r], no_restart=True)

    def close(self) -> None:
        for actor in [*self.workers, *self.shards]:
            ray.kill(actor, no_restart=True)
        if self.placement is not None:
            remove_placement_group(self.placement)


class RolloutHost:
    """What GRPO's rollout replicas get from the cluster: their seats, their workers' plans beside them, and the
    weights' version to read. Calls to actors are returned to wait for (`remote.wait_replies` names the late)."""

    def __init__(self, actors: ClusterActors, place: RolloutPlace, version: Callable[[], WeightsVersion],
                 timeout_s: float):
        self._actors = actors
        self._place = place
        self._version = version
        self.num_workers = actors.want.num_workers
        self.timeout_s = timeout_s  # `cluster.step_timeout_s`: every wait for a replica is bounded by it

    @property
    def shares_gpu(self) -> bool:
        """Whether each replica runs on its worker's GPU (else on CPUs, or on GPUs of its own)."""
        return self._place.shared and bool(self._actors.want.gpus_per_worker)

    def seats(self) -> list[ReplicaSeat]:
        """Where each replica runs (beside each worker, or one with GPUs of its own on node 0), and its arena."""
        actors, shared = self._actors, self._place.shared
        return [ReplicaSeat(w, f"the rollout replica beside worker {w}" if shared else "the rollout replica",
                            actors.rollout_options(w), actors.run, actors.arenas[actors.node_of(w)],
                            int(actors.cluster.cpus_per_worker))
                for w in self._place.beside(self.num_workers)]

    def worker_devices(self, ranks: list[int]) -> list[ray.ObjectRef]:
        """Each worker's CUDA devices (the GPU its replica shares)."""
        return [self._actors.workers[w].__ray_call__.remote(worker_devices) for w in ranks]

    def plan_beside(self, beside: RolloutBeside) -> list[ray.ObjectRef]:
        """Every worker plans its GPU with a replica beside it (each answers the replica's placement); workers
        started later plan the same."""
        self._actors.rollout_beside = beside
        return [w.plan_rollout.remote(beside) for w in self._actors.workers]

    def version(self) -> WeightsVersion:
        """The weights after every step so far, as a replica reads them."""
        return self._version()
