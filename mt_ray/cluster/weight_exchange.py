"""The weight exchange of a coordinator shard (mt_ray.cluster.shard): which version of each unit its node's arena
holds, and, with several nodes, the updated units it sends the others and those it receives.

An owned unit's version word is bumped as its update lands (`on_updated`): that is all a local worker waits for.
With several nodes the owner also casts the unit to the compute dtype and sends it to every other node's shard
(`put_weights`), which copies it into its arena and bumps its word there. The owner updated it only once every
node's partial sum of it was in, so no node's workers are still uploading the version it replaces.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import ray
import torch

from mt_ray.cluster.arena import ABSENT, PRESENT, NodeArena
from mt_ray.cluster.errors import ClusterError, StaleGenerationError
from mt_ray.cluster.shard_state import PEER_WAIT_S, Generation, ShardStatus, ShardUnits, read_unless_stopped
from mt_ray.cluster.wire import from_numpy, to_numpy
from mt_ray.engine.host_store import HostStore

PUBLISH_THREADS = 2  # casts and puts of updated units for other nodes, beside the optimizer (several nodes only)


class WeightExchange:
    """Version words of the node's arena, and updated units between nodes (`dtype`: the compute dtype)."""

    def __init__(self, units: ShardUnits, arena: NodeArena, store: HostStore, dtype: torch.dtype,
                 status: ShardStatus):
        self.units = units
        self.arena = arena
        self.store = store
        self.dtype = dtype
        self.status = status
        self.peers: list = []  # every shard's handle, by shard index
        self.busy_s = 0.0
        self._casts = self._build_casts()
        self._publisher = ThreadPoolExecutor(PUBLISH_THREADS, thread_name_prefix="mt-ray-publish")
        owned = set(units.owned)
        # A copy of another node's unit and a new generation's reset of its word, one at a time.
        self._copying = {u.name: threading.Lock() for u in units.spec.units if u.name not in owned}

    @property
    def _sends(self) -> bool:
        return self.units.num_shards > 1

    def _build_casts(self) -> queue.Queue:
        """Unit-sized compute-dtype buffers that owned units are cast into for other nodes (none on one node)."""
        casts: queue.Queue = queue.Queue()
        if self._sends and self.units.owned:
            size = max(self.units.spec.unit(u).numel for u in self.units.owned)
            for _ in range(PUBLISH_THREADS):
                casts.put(torch.empty(size, dtype=self.dtype))
        return casts

    def begin(self, gen: Generation) -> None:
        """Before `gen` runs: owned units hold the weights of its step (a frozen one every step's), the others none
        until their owners send them."""
        for unit in self.units.spec.units:
            if unit.name in self.units.owned:
                self.arena.set_version(unit.name, PRESENT if unit.frozen else gen.step)
            else:
                with self._copying[unit.name]:  # a late copy of the last generation's weights cannot mark itself
                    self.arena.set_version(unit.name, ABSENT)

    def publish_all(self, gen: Generation) -> None:
        """Once `gen` runs: every owned unit goes to the other nodes, this generation's weights (several nodes)."""
        for name in self.units.owned if self._sends else ():
            self._publisher.submit(self._publish, gen, name, PRESENT if name in self.units.frozen else gen.step)

    def on_updated(self, gen: Generation, unit: str, version: int) -> None:
        """On the optimizer thread, as an owned `unit` reaches `version`: tell this node's workers, and the others."""
        self.arena.set_version(unit, version)
        if self._sends and not gen.stopped:
            self._publisher.submit(self._publish, gen, unit, version)

    def put_weights(self, generation: int, unit: str, version: int, weights: list[ray.ObjectRef]) -> None:
        """Another shard's unit after `version` steps, in the compute dtype: copied into this node's arena."""
        gen = self.status.generation_of(generation)
        if gen is None:
            return
        try:
            array = read_unless_stopped(gen, weights[0], f"{unit}'s weights of step {version}")
        except StaleGenerationError:
            return
        with self._copying[unit]:
            if self.status.stale(generation):
                return
            self.arena.weights(unit).copy_(from_numpy(array, self.dtype))
            self.arena.set_version(unit, version)

    def close(self) -> None:
        self._publisher.shutdown(wait=False)

    def _publish(self, gen: Generation, unit: str, version: int) -> None:
        """Cast an owned unit to the compute dtype and send it to every other node's shard."""
        t0 = time.perf_counter()
        try:
            cast = self._casts.get(timeout=PEER_WAIT_S)  # both buffers busy: a put of this node's is hung
        except queue.Empty:
            self.status.fail(ClusterError(f"shard {self.units.shard}: no cast buffer came free within "
                                          f"{PEER_WAIT_S:g} s to publish {unit} at step {version}"))
            return
        try:
            ref = ray.put(to_numpy(cast[: self.units.spec.unit(unit).numel].copy_(self.store.master_of(unit))))
        finally:
            self._casts.put(cast)
        calls = [p.put_weights.remote(gen.number, unit, version, [ref])
                 for i, p in enumerate(self.peers) if i != self.units.shard]
        self.busy_s += time.perf_counter() - t0
        try:
            ray.get(calls, timeout=PEER_WAIT_S)
        except BaseException as e:  # a peer lost or hung: the driver finds out from its own calls
            self.status.note(e, gen.number)
