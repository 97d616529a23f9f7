"""What a data-parallel run costs each node: host memory, object store, network, from the allocation plan.

Per node (the most loaded one): its coordinator shard's fp32 state (12 B/param of its part; 4 for
a frozen unit, which has no moments), whose master is part of the node's shared-memory arena;
the rest of the arena (other nodes' units in the compute dtype, a preference stage's reference in
it, a gradient slot per trained unit the node owns, a pool of a few units where the node sums those it does not,
and a gradient ring for each worker after the node's first); each worker's own process; and an
object store that carries only batches and, with several nodes, unit-sized transfers between them.
The worker count adds only its rings and processes: `per_worker_bytes`, named, and nothing model-sized.
GRPO adds a rollout replica's process beside each worker (its copy of the policy is on the worker's GPU, refreshed
from the arena it maps).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mt_ray.cluster.arena import ACK_WORDS, FORWARD_INFLIGHT, ring_numel
from mt_ray.cluster.partition import ShardPlan, state_cost
from mt_ray.cluster.run_spec import plan_nodes
from mt_ray.cluster.weight_exchange import PUBLISH_THREADS
from mt_ray.engine.config import EngineConfig, OptimizerConfig
from mt_ray.models.discovery import ModelSpec

GIB = 1024**3
# A worker process's own memory beside the arena it maps (Python, torch, transformers, Ray's core worker,
# the CUDA context's host side): 1.13 GiB private on the H100 with the 7B shape (bench/multi_gpu.py).
WORKER_PROCESS_BYTES = int(1.15 * GIB)
ACK_BYTES = 8 * ACK_WORDS  # a landing worker's acknowledgement words in the arena
# Each node's fixed cost beside its state and workers: the shard's own process (0.78 GiB private beyond its
# moments on the H100 with the 7B shape), Ray's daemons (about 0.45 GiB), the page tables of the arena's mappings.
NODE_BASE_BYTES = int(1.5 * GIB)
STORE_BASE_BYTES = 64 << 20  # batches and small objects
STORE_SLACK = 1.05  # the object store's allocator needs some room beyond the objects themselves


@dataclass(frozen=True)
class ClusterSizing:
    """Bytes per node of a data-parallel run (the largest shard's node)."""

    num_nodes: int
    workers_per_node: int
    params: int
    shard_params: int
    state_bytes: int
    arena_bytes: int  # beside the master, which `state_bytes` counts
    reference_bytes: int  # of `arena_bytes`: a preference stage's reference (compute dtype), once per node
    slot_bytes: int  # of `arena_bytes`: the gradient slots of the trained units the node owns
    pool_bytes: int  # of `arena_bytes`: where the node sums the units other nodes own (a few units; 0 on one node)
    rings: int  # one for each worker after the node's first, which lands in the slots (none with grad_reduce nccl)
    landers: int  # workers landing gradients on the node (each has acknowledgement words in the arena)
    ring_bytes: int
    worker_process_bytes: int
    rollout_process_bytes: int  # GRPO's rollout replicas, one beside each worker (0 for the other stages)
    object_store_bytes: int
    network_out_bytes_per_step: int
    network_in_bytes_per_step: int

    @property
    def per_worker_bytes(self) -> int:
        """What each further worker on a node adds: its gradient ring, its acknowledgement words and its process."""
        return self.ring_bytes + ACK_BYTES + self.worker_process_bytes

    @property
    def node_host_bytes(self) -> int:
        return self.state_bytes + self.arena_bytes + self.rings * self.ring_bytes + self.landers * ACK_BYTES \
            + self.workers_per_node * self.worker_process_bytes + self.rollout_process_bytes \
            + self.object_store_bytes + NODE_BASE_BYTES

    @property
    def node_host_bytes_per_param(self) -> float:
        return self.node_host_bytes / self.params

    def as_dict(self) -> dict:
        return {**asdict(self), "per_worker_bytes": self.per_worker_bytes, "node_host_bytes": self.node_host_bytes,
                "node_host_bytes_per_param": self.node_host_bytes_per_param}


def size_cluster(spec: ModelSpec, cfg: EngineConfig, opt: OptimizerConfig, num_workers: int,
                 num_nodes: int, grad_reduce: str = "host", ring_mb: float | None = None,
                 reference: bool = False, rollout: bool = False) -> ClusterSizing:
    """The plan of `num_workers` workers spread over `num_nodes` nodes, one coordinator shard each (`grad_reduce`
    nccl: the node's GPUs sum gradients between them, so only one lands, and no worker has a ring; `ring_mb`:
    `cluster.grad_ring_mb`; `reference`: the stage streams a reference, `Stage.reference`; `rollout`: a GRPO
    rollout replica runs beside each worker, each counted as a worker's process; one with GPUs of its own,
    `cluster.rollout_gpus`, is counted the same way, an upper bound)."""
    plan = ShardPlan.build(spec, num_nodes)
    per_node = num_workers // num_nodes
    w, g = cfg.dtype.itemsize, cfg.grad_torch_dtype.itemsize
    loads = [sum(state_cost(u) for u in part) for part in plan.parts]
    node = loads.index(max(loads))  # the most loaded node's
    part = plan.parts[node]
    shard = sum(u.numel for u in part)
    shard_trained = sum(u.numel for u in part if not u.frozen)
    # The layout the driver hands that node's actors (`plan_nodes`), in the configured dtypes.
    layout = plan_nodes(spec, plan, cfg, per_node, landers(per_node, grad_reduce),
                        ring_numel(spec, cfg.grad_torch_dtype, ring_mb), reference)[node].layout
    rings = layout.num_rings * layout.ring_bytes
    acks = layout.num_local * ACK_BYTES
    largest = max(u.numel for u in spec.units)
    # Several nodes, at most unit-sized objects each: per peer, FORWARD_INFLIGHT partial sums this node has put for
    # it and as many of its own pulled here, and PUBLISH_THREADS of its updated units pulled here; beside them this
    # node's own PUBLISH_THREADS updated units, put once for every peer.
    peers = num_nodes - 1
    partials = 2 * FORWARD_INFLIGHT * max(u.numel for u in spec.trainable_units) * g
    transit = peers * (partials + PUBLISH_THREADS * largest * w) + PUBLISH_THREADS * largest * w if peers else 0
    # Trained units this node neither owns nor updates: their gradients go out, their new weights come in.
    remote = sum(u.numel for u in spec.trainable_units) - shard_trained
    return ClusterSizing(
        num_nodes=num_nodes, workers_per_node=per_node, params=spec.num_params, shard_params=shard,
        state_bytes=sum(state_cost(u) for u in part), arena_bytes=layout.nbytes - 4 * layout.master_numel - rings - acks,
        reference_bytes=layout.reference_bytes, slot_bytes=layout.slot_bytes, pool_bytes=layout.pool_bytes,
        rings=layout.num_rings, landers=layout.num_local, ring_bytes=layout.ring_bytes,
        worker_process_bytes=WORKER_PROCESS_BYTES, rollout_process_bytes=per_node * WORKER_PROCESS_BYTES if rollout else 0,
        object_store_bytes=int(transit * STORE_SLACK) + STORE_BASE_BYTES,
        network_out_bytes_per_step=(remote * g + shard_trained * w * (num_nodes - 1)) if num_nodes > 1 else 0,
        network_in_bytes_per_step=(remote * w + shard_trained * g * (num_nodes - 1)) if num_nodes > 1 else 0,
    )


def landers(workers_per_node: int, grad_reduce: str) -> int:
    """Workers of a node whose gradients land in its arena: one where the GPUs sum them between them."""
    return 1 if grad_reduce == "nccl" else workers_per_node


def render_cluster(sizing: ClusterSizing) -> str:
    """The per-node figures, for `mt-ray calc --workers N --nodes M`."""
    s = sizing
    rows = [
        ("nodes x workers per node", f"{s.num_nodes} x {s.workers_per_node}"),
        ("shard state (fp32 master, m, v)", f"{s.state_bytes / GIB:.1f} GiB"),
        ("shared arena beside the master", f"{s.arena_bytes / GIB:.1f} GiB (gradients {s.slot_bytes / GIB:.1f}, "
                                           f"pool {s.pool_bytes / GIB:.1f}, other nodes' weights"
                                           + (f", reference {s.reference_bytes / GIB:.1f} GiB)" if s.reference_bytes
                                              else ")")),
        ("per worker (ring + process)", f"{s.per_worker_bytes / GIB:.2f} GiB"),
        *([("GRPO rollout replicas (processes)", f"{s.rollout_process_bytes / GIB:.2f} GiB")] if s.rollout_process_bytes
          else []),
        ("object store", f"{s.object_store_bytes / GIB:.2f} GiB"),
        ("shard process, Ray's daemons", f"{NODE_BASE_BYTES / GIB:.1f} GiB"),
        ("host per node", f"{s.node_host_bytes / GIB:.1f} GiB ({s.node_host_bytes_per_param:.1f} B/param)"),
        ("network per step per node", f"out {s.network_out_bytes_per_step / GIB:.1f} GiB, "
                                      f"in {s.network_in_bytes_per_step / GIB:.1f} GiB"),
    ]
    return "\n".join(f"{k:>32}: {v}" for k, v in rows)
