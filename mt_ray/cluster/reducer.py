"""The node reducer: one per node of a multi-node run, so only per-node gradient sums cross nodes.

Workers on a node hand each unit gradient to their node's reducer instead of the coordinator.
Once every local worker's gradient of a unit is in, the reducer sums them in fp32 (in rank
order, so the sum does not depend on arrival order) and sends that one sum on to the
coordinator, which adds the nodes' sums as it would add workers' gradients. Weights need no
relay: a published object is pulled to each node once, and the node's workers map that copy.
"""

from __future__ import annotations

import threading

import numpy as np
import ray

from mt_ray.cluster.wire import sum_fp32, to_numpy
from mt_ray.engine.config import EngineConfig


class NodeReducer:
    """A Ray actor on one node; its workers call `put_grad` on it as they would on the coordinator."""

    def __init__(self, coordinator, node: int, num_local: int, engine_cfg: dict):
        cfg = EngineConfig(**engine_cfg)  # resolved here, on the workers' node, as the workers resolve it
        self.coordinator = coordinator
        self.node = node
        self.num_local = num_local
        self.wire_dtype = cfg.grad_torch_dtype
        self.generation = 0
        self._lock = threading.Lock()
        self._arrived: dict[tuple[int, str], dict[int, np.ndarray]] = {}

    def put_grad(self, generation: int, step: int, rank: int, unit: str, grad: np.ndarray) -> float | None:
        """One local worker's gradient; the call that completes the unit forwards the node's sum.

        Returns what the coordinator returns for that sum (the step's gradient norm if it ended
        the step), so a worker's flush still means "the coordinator has it".
        """
        with self._lock:
            if generation < self.generation:
                return None  # a worker of an aborted generation
            if generation > self.generation:  # a recovery or restore began a new generation
                self.generation = generation
                self._arrived.clear()
            got = self._arrived.setdefault((step, unit), {})
            got[rank] = grad
            if len(got) < self.num_local:
                return None
            del self._arrived[(step, unit)]
        summed = sum_fp32([got[r] for r in sorted(got)], self.wire_dtype)
        del got  # the workers' objects can be freed now
        ref = ray.put(to_numpy(summed))  # the one copy that leaves this node
        return ray.get(self.coordinator.put_grad.remote(generation, step, self.node, unit, ref))

    def node_id(self) -> str:
        """The Ray node this reducer runs on (also a liveness check)."""
        return ray.get_runtime_context().get_node_id()
