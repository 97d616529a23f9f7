"""What a data-parallel run costs each node: host memory, object store, network, from the allocation plan.

Per node: its coordinator shard's fp32 master and moments (12 B/param of its part; 4 for a frozen
unit, which has no moments), the shard's few unit-sized sum and cast buffers, each worker's
gradient slabs, and the object store. The object store holds the current weights of every unit
(every node's workers read all of them), the gradients waiting for the clip norm (they fill the
space the backward pass frees as it releases each unit's weights, so the two share it), and a
few unit-sized gradients in flight. Frozen units send no gradient, and their weights cross the
network once per run, not every step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mt_ray.cluster.partition import ShardPlan, state_cost
from mt_ray.cluster.shard import SHARD_BUFFERS
from mt_ray.cluster.worker import GRADS_IN_FLIGHT, WORKER_GRAD_SLABS
from mt_ray.engine.config import EngineConfig, OptimizerConfig
from mt_ray.models.discovery import ModelSpec

GIB = 1024**3
STORE_SLACK = 1.05  # the object store's allocator needs some room beyond the objects themselves
STORE_BASE_BYTES = 64 << 20  # small objects, metadata, and what a tiny model would round to nothing


@dataclass(frozen=True)
class ClusterSizing:
    """Bytes per node of a data-parallel run (the largest shard's node)."""

    num_nodes: int
    workers_per_node: int
    params: int
    shard_params: int
    state_bytes: int
    shard_buffer_bytes: int
    worker_slab_bytes: int
    object_store_bytes: int
    network_out_bytes_per_step: int
    network_in_bytes_per_step: int

    @property
    def node_host_bytes(self) -> int:
        return self.state_bytes + self.shard_buffer_bytes + self.worker_slab_bytes + self.object_store_bytes

    @property
    def node_host_bytes_per_param(self) -> float:
        return self.node_host_bytes / self.params

    def as_dict(self) -> dict:
        return {**asdict(self), "node_host_bytes": self.node_host_bytes,
                "node_host_bytes_per_param": self.node_host_bytes_per_param}


def size_cluster(spec: ModelSpec, cfg: EngineConfig, opt: OptimizerConfig, num_workers: int,
                 num_nodes: int) -> ClusterSizing:
    """The plan of `num_workers` workers spread over `num_nodes` nodes, one coordinator shard each."""
    plan = ShardPlan.build(spec, num_nodes)
    per_node = num_workers // num_nodes
    w, g = cfg.dtype.itemsize, cfg.grad_torch_dtype.itemsize
    sizes = sorted((u.numel for u in spec.units), reverse=True)  # every unit is cast and published
    grad_sizes = sorted((u.numel for u in spec.trainable_units), reverse=True)  # gradients come for these

    def largest(k: int) -> int:
        """Elements of the k largest trained units: a bound on any k unit gradients alive at once."""
        return sum(grad_sizes[:k])

    part = max(plan.parts, key=lambda units: sum(state_cost(u) for u in units))  # the most loaded node's
    shard = sum(u.numel for u in part)
    shard_trained = sum(u.numel for u in part if not u.frozen)
    clips = opt.max_grad_norm > 0
    # Weights and held gradients share the space: every worker lets a unit's weights go once its last
    # upload of the step has landed, before that unit's gradient exists.
    shared = spec.num_params * w + (shard_trained * max(0, g - w) if clips else 0)
    in_flight = (per_node * largest(GRADS_IN_FLIGHT) + (num_nodes - 1) * grad_sizes[0]) * g
    # Trained units this node neither owns nor updates: their gradients go out, their new weights come in.
    remote = sum(u.numel for u in spec.trainable_units) - shard_trained
    return ClusterSizing(
        num_nodes=num_nodes, workers_per_node=per_node, params=spec.num_params, shard_params=shard,
        state_bytes=sum(state_cost(u) for u in part),
        shard_buffer_bytes=SHARD_BUFFERS * sizes[0] * max(w, g),
        worker_slab_bytes=per_node * WORKER_GRAD_SLABS * grad_sizes[0] * g,
        object_store_bytes=int((shared + in_flight) * STORE_SLACK) + STORE_BASE_BYTES,
        network_out_bytes_per_step=(remote * g + shard_trained * w * (num_nodes - 1)) if num_nodes > 1 else 0,
        network_in_bytes_per_step=(remote * w + shard_trained * g * (num_nodes - 1)) if num_nodes > 1 else 0,
    )


def render_cluster(sizing: ClusterSizing) -> str:
    """The per-node figures, for `mt-ray calc --workers N --nodes M`."""
    s = sizing
    rows = [
        ("nodes x workers per node", f"{s.num_nodes} x {s.workers_per_node}"),
        ("shard state (fp32 master, m, v)", f"{s.state_bytes / GIB:.1f} GiB"),
        ("shard sum/cast buffers", f"{s.shard_buffer_bytes / GIB:.1f} GiB"),
        ("workers' gradient slabs", f"{s.worker_slab_bytes / GIB:.1f} GiB"),
        ("object store", f"{s.object_store_bytes / GIB:.1f} GiB"),
        ("host per node", f"{s.node_host_bytes / GIB:.1f} GiB ({s.node_host_bytes_per_param:.1f} B/param)"),
        ("network per step per node", f"out {s.network_out_bytes_per_step / GIB:.1f} GiB, "
                                      f"in {s.network_in_bytes_per_step / GIB:.1f} GiB"),
    ]
    return "\n".join(f"{k:>32}: {v}" for k, v in rows)
