"""A coordinator shard: one per node, holding the fp32 master weights and Adam moments of its part.

The model is cut into contiguous parts (mt_ray.cluster.partition), one per node. Each node's
shard owns the node's shared-memory arena (mt_ray.cluster.arena), whose weights its workers
stream and whose gradient slots, pool and rings they land their gradients in. It plays two roles:
- **node reducer** (mt_ray.cluster.shard_sums). A worker tells it where each unit gradient landed
  (`put_grad`, a few bytes): the node's first worker lands it whole, in the unit's slot, or in the
  node's pool for a unit another node owns (a lone worker's is the sum); the others in pieces in
  their rings. Each range is summed in fp32, in rank order, and rounded once into the first
  worker's landing. The node's sum of a unit another shard owns is sent to that owner, once.
- **owner.** For its own units it adds the nodes' partial sums (node order) in the slot and
  hands the slot to the engine's `OptimizerWorker`, which updates the master in place, in the
  arena. Each update bumps the unit's version word there, which is all a local worker waits
  for; with several nodes the owner also sends the unit's compute-dtype weights to the other
  nodes' shards, which copy them into their arenas.
- **reference keeper.** A preference stage that streams a reference gets it in the arena: every
  unit's starting weights, written in the compute dtype as they are loaded (each shard reads the
  whole checkpoint or initialisation anyway), once per node; a checkpoint restores the policy only.
A frozen unit (an image-text model's vision tower, by default) is never updated: it is present
at every version. A vision unit that no worker's rows used in a step (no image anywhere in the
batch) arrives as None from every worker: like torch with a None gradient, it is left as it
is, Adam count included. With clipping, the driver gathers each shard's norm² of its summed
units (or, with one worker in the run, takes the worker's own GPU norm, as the single engine
does) and hands the global norm back (`apply_norm`); no unit is updated before every gradient
of the step is in.

Sums run on one reduce thread and Adam on the optimizer thread, each with an intra-op team of its own
(`shard_state.split_threads`): numba's, whose count holds per thread (`cluster.grad_sum`, `engine.host_adamw`).
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import ray
import torch
from ray.exceptions import GetTimeoutError

from mt_ray.cluster.arena import ABSENT, FAILED, PRESENT, STOPPED, ArenaHandle, NodeArena
from mt_ray.cluster.errors import ClusterError, StaleGenerationError
from mt_ray.cluster.grad_sum import sum_in_order, use_sum_threads
from mt_ray.cluster.node_memory import NodeMemoryPeak
from mt_ray.cluster.partition import ShardPlan
from mt_ray.cluster.recovery import StepReport
from mt_ray.cluster.run_spec import NodePlan, RunSpec
from mt_ray.cluster.shard_io import ShardStateIO
from mt_ray.cluster.shard_state import (
    PEER_WAIT_S,
    Generation,
    GradSlots,
    Snapshot,
    read_unless_stopped,
    split_threads,
)
from mt_ray.cluster.shard_sums import ShardSums
from mt_ray.cluster.wire import from_numpy, to_numpy
from mt_ray.engine.host_store import HostStore
from mt_ray.engine.optimizer import UnitOptimizer, lr_at
from mt_ray.engine.optimizer_worker import OptimizerWorker

PUBLISH_THREADS = 2  # casts and puts of updated units for other nodes, beside the optimizer (several nodes only)


class CoordinatorShard(ShardSums, ShardStateIO):
    """A Ray actor with concurrent (threaded) calls; see the module docstring."""

    def __init__(self, run: RunSpec, node: NodePlan, snapshot_every: int = 0):
        """The shard of `node` in the run `run`; its arena is laid out as the driver planned (`node.layout`).
        `snapshot_every`: `cluster.snapshot_every`."""
        self.node_memory = NodeMemoryPeak()  # before anything of the run is allocated here
        self.spec = run.discover()
        self.cfg = run.engine
        self.opt_cfg = run.optimizer
        num_local, num_shards, shard = node.landers, run.num_nodes, node.node
        self.threads, sum_threads = split_threads(self.cfg.optimizer_thread_count, sums=num_local > 1 or num_shards > 1)
        torch.set_num_threads(self.threads)  # Ray starts actors with OMP_NUM_THREADS=1
        self.total_steps = run.total_steps
        self.shard, self.num_shards = shard, num_shards
        self.num_local = num_local
        self.snapshot_every = snapshot_every
        self.plan = ShardPlan.build(self.spec, num_shards)
        self.owned = self.plan.units_of(shard)
        self.owned_names = [u.name for u in self.owned]
        self.trained = [u.name for u in self.owned if not u.frozen]  # the units gradients come for
        self.frozen = {u.name for u in self.spec.units if u.frozen}
        self.clips = self.opt_cfg.max_grad_norm > 0
        # One lander on one node (a lone worker, or a node's GPUs summing with NCCL): its engine's GPU norm is the
        # global one, taken as one engine takes it; the driver hands it over.
        self.gpu_norm = num_local == 1 and num_shards == 1
        layout = node.layout
        self.arena = NodeArena.create(layout, self.cfg.host_memory_limit_gb)
        # Where the workers' pieces of each gradient start and end (the first worker's lands whole; with no
        # further workers, so does every gradient).
        self.pieces = {u.name: dict(layout.pieces(u.numel) if num_local > 1 else [(0, u.numel)])
                       for u in self.spec.trainable_units}
        # The configured limit is checked per node against the whole plan by the driver (check_plan).
        self.store = HostStore(self.spec, None, False, 0, None, units=self.owned, master=self.arena.master())
        self.optimizers = {name: UnitOptimizer(self.store, self.spec.unit(name), self.opt_cfg) for name in self.trained}
        self.slots = GradSlots({u.name: u.numel for u in self.spec.trainable_units})
        self._casts = self._build_casts()
        self._publisher = ThreadPoolExecutor(PUBLISH_THREADS, thread_name_prefix="mt-ray-publish")
        # The sums run on numba's team, sized for the reduce thread alone (numba's count holds per thread).
        self._forwarder = ThreadPoolExecutor(1, thread_name_prefix="mt-ray-forward")  # partial sums to other nodes
        self._reducer = ThreadPoolExecutor(1, thread_name_prefix="mt-ray-reduce", initializer=use_sum_threads,
                                           initargs=(sum_threads,))
        self.peers: list = []
        self._cond = threading.Condition()
        self._copying = {u.name: threading.Lock() for u in self.spec.units if u.name not in self.owned_names}
        self._snapshot: Snapshot | None = None
        self._error: BaseException | None = None
        self.gen: Generation | None = None
        self.seconds = {"sum": 0.0, "publish": 0.0, "adam": 0.0}  # busy time, for the benchmark's time split

    def _build_casts(self) -> queue.Queue:
        """Unit-sized compute-dtype buffers that owned units are cast into for other nodes (none on one node)."""
        casts: queue.Queue = queue.Queue()
        if self.num_shards > 1 and self.owned:
            size = max(u.numel for u in self.owned)
            for _ in range(PUBLISH_THREADS):
                casts.put(torch.empty(size, dtype=self.cfg.dtype))
        return casts

    def set_peers(self, peers: list) -> None:
        """Every shard's handle, by shard index (partial sums go to their unit's owner)."""
        self.peers = peers

    def arena_handle(self) -> ArenaHandle:
        """What this node's workers map the arena with."""
        return self.arena.handle()

    # ------------------------------------------------------------------ generations

    def start(self, generation: int, step: int, restore_snapshot: bool = False) -> int:
        """Begin `generation` at `step`: retire the last one's optimizer, mark the weights of `step` as current.

        With `restore_snapshot`, the state (Adam counts included) first goes back to the snapshot; returns its
        step. Otherwise the counts stay: they are the updates each unit has had (a vision unit skips steps
        without images), whether `step` redoes a stopped step or follows a completed one.
        """
        old = self.gen
        if old is not None:
            old.stopped = True  # what its optimizer still applies is not sent on: this generation republishes all
            old.opt.close()  # applies what was queued (an ended step's updates, or unclipped ones)
            self.seconds["adam"] += old.opt.busy_seconds
        if restore_snapshot:
            step = self._restore_snapshot(step)
        gen = Generation(generation, step)
        gen.opt = OptimizerWorker(self.store, self.optimizers, self.slots, self.trained, self.opt_cfg.max_grad_norm,
                                  self.threads, on_advance=lambda unit, version: self._on_advance(gen, unit, version),
                                  on_error=self._on_optimizer_error)
        gen.opt.reset_versions(step)
        for unit in self.spec.units:
            if unit.name in self.owned_names:
                self.arena.set_version(unit.name, PRESENT if unit.frozen else step)
            else:
                with self._copying[unit.name]:  # a late copy of the last generation's weights cannot mark itself
                    self.arena.set_version(unit.name, ABSENT)
        with self._cond:
            self.gen = gen
            self._error = None
            self._cond.notify_all()  # messages of this generation that came early
        self.arena.begin(generation)
        if self.snapshot_every and self.trained and (self._snapshot is None or step % self.snapshot_every == 0):
            self._take_snapshot(step)
        for name in self.owned_names if self.num_shards > 1 else ():
            self._publisher.submit(self._publish, gen, name, PRESENT if name in self.frozen else step)
        return step

    def stop(self, step: int) -> StepReport:
        """Refuse this generation's calls from now on (a worker was lost in `step`); report what `step` reached.

        complete: every gradient of this shard's units is summed (with `norm_sq`); touched: some
        unit was updated (only without clipping, where units update as their sums land).
        """
        with self._cond:
            gen = self.gen
            gen.stopped = True
            self._cond.notify_all()
        self.arena.set_state(STOPPED)  # workers waiting for weights or for acknowledgements give up
        with self._cond:
            for summed in gen.partials_summed.values():  # peers waiting for a sum that will not come
                summed.set()
        self._reducer.submit(lambda: None).result()  # sums already queued have finished
        norms = gen.norms.get(step, {})
        complete = step in gen.ended or len(norms) == len(self.trained)
        norm_sq = None
        if complete and step not in gen.ended:
            # A lone worker's norm was its GPU's, lost with it: taken here from the slots it landed in instead.
            norm_sq = self._norm_total({u: sum_in_order([self.arena.grad(u)], None) if n is None else n
                                        for u, n in norms.items()})
        return StepReport(complete, step in gen.touched, norm_sq, self._snapshot.step if self._snapshot else None)

    def wait_updated(self, version: int) -> None:
        """Block until every trained unit of this shard has had `version` optimizer steps."""
        for unit in self.trained:
            self.gen.opt.wait_updated(unit, version)

    def busy_seconds(self) -> dict[str, float]:
        """Cumulative busy time of the sums, the publication puts and Adam (this generation's optimizer)."""
        return {**self.seconds, "adam": self.seconds["adam"] + self.gen.opt.busy_seconds}

    def units_summed(self, step: int) -> int:
        """How many of this shard's units of `step` are summed (for monitoring and tests)."""
        with self._cond:
            if step in self.gen.ended:
                return len(self.trained)
            return len(self.gen.norms.get(step, {}))

    def pending(self, step: int) -> dict[str, list[int]]:
        """Units of `step` not yet summed here, each with the local workers whose gradient of it is in
        (what a hung step waits for)."""
        with self._cond:
            gen = self.gen
            done = set(gen.norms.get(step, {})) if step not in gen.ended else set(self.trained)
            local = {u: landing.ranks_in() for (s, u), landing in gen.local.items() if s == step}
            return {u: local.get(u, []) for u in self.trained if u not in done} | local

    def ping(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def close(self) -> None:
        self.node_memory.close()
        if self.gen is not None:
            self.gen.opt.close()
        self._publisher.shutdown(wait=False)
        self._reducer.shutdown(wait=False)
        self._forwarder.shutdown(wait=False)

    # ------------------------------------------------------------------ workers' calls

    def put_weights(self, generation: int, unit: str, version: int, weights: list[ray.ObjectRef]) -> None:
        """Another shard's unit after `version` steps, in the compute dtype: copied into this node's arena.

        The owner updated it only once this node's partial sum of it was in, so this node's workers
        have finished their uploads of the version it replaces.
        """
        gen = self._generation_of(generation)
        if gen is None:
            return
        try:
            array = read_unless_stopped(gen, weights[0])
        except StaleGenerationError:
            return
        with self._copying[unit]:
            if self._stale(generation):
                return
            self.arena.weights(unit).copy_(from_numpy(array, self.cfg.dtype))
            self.arena.set_version(unit, version)

    def _generation_of(self, generation: int) -> Generation | None:
        """The running generation if it is `generation` (waiting, bounded, for this shard to start it), else None."""
        with self._cond:
            self._cond.wait_for(lambda: self.gen is not None and self.gen.number >= generation, timeout=PEER_WAIT_S)
            return None if self._stale(generation) else self.gen

    def local_norm_sq(self, generation: int, step: int, timeout_s: float = PEER_WAIT_S) -> float:
        """Once every unit of this shard is summed for `step` (and partials sent on have arrived): its norm²
        (0 with one worker in the run: the driver takes its GPU's). Bounded by `timeout_s`, naming what is missing."""
        with self._cond:
            done = self._cond.wait_for(lambda: self._stale(generation) or self._error is not None
                                       or len(self.gen.norms.get(step, {})) == len(self.trained), timeout=timeout_s)
            self._raise_if_stale(generation)
            gen = self.gen
            if not done:
                missing = [u for u in self.trained if u not in gen.norms.get(step, {})]
                raise ClusterError(f"shard {self.shard}: step {step}'s sums of {missing[:4]} ({len(missing)} units) "
                                   f"did not come within {timeout_s:g} s (cluster.step_timeout_s)")
        try:  # the owners have our partial sums (surfaces their errors)
            ray.get(gen.forwarded.pop(step, []), timeout=timeout_s)
        except GetTimeoutError:
            raise ClusterError(f"shard {self.shard}: another node's shard did not take step {step}'s partial sums "
                               f"within {timeout_s:g} s (cluster.step_timeout_s)") from None
        return self._norm_total(gen.norms.get(step, {}))  # a shard of frozen units alone has none

    def apply_norm(self, step: int, norm_sq: float) -> None:
        """The step's global norm² (from every shard): the clipped updates of this shard's units begin."""
        gen = self.gen
        gen.norms.pop(step, None)
        gen.ended.add(step)
        gen.opt.end_step(torch.tensor(norm_sq, dtype=torch.float32), None, lr_at(step, self.opt_cfg, self.total_steps))

    # ------------------------------------------------------------------ updates out

    def _on_optimizer_error(self, error: BaseException) -> None:
        """The optimizer thread failed: the driver's calls and the workers' waits for weights end with an error."""
        with self._cond:
            self._error = self._error or error
            self._cond.notify_all()
        self.arena.set_state(FAILED)

    def _on_advance(self, gen: Generation, unit: str, version: int) -> None:
        """On the optimizer thread, as `unit` reaches `version`: tell this node's workers, and the other nodes.

        The last trained unit to reach a snapshot's version takes the snapshot before its version is
        out: until then no worker can finish the next forward pass, so no update of the next step can
        race with the copy.
        """
        with self._cond:
            count = gen.advanced[version] = gen.advanced.get(version, 0) + 1
            if count == len(self.trained):
                del gen.advanced[version]
        if count == len(self.trained) and self.snapshot_every and version % self.snapshot_every == 0:
            self._take_snapshot(version)
        self.arena.set_version(unit, version)
        if self.num_shards > 1 and not gen.stopped:
            self._publisher.submit(self._publish, gen, unit, version)

    def _publish(self, gen: Generation, unit: str, version: int) -> None:
        """Cast an owned unit to the compute dtype and send it to every other node's shard (several nodes)."""
        t0 = time.perf_counter()
        cast = self._casts.get()
        try:
            ref = ray.put(to_numpy(cast[: self.spec.unit(unit).numel].copy_(self.store.master_of(unit))))
        finally:
            self._casts.put(cast)
        calls = [p.put_weights.remote(gen.number, unit, version, [ref]) for i, p in enumerate(self.peers) if i != self.shard]
        self.seconds["publish"] += time.perf_counter() - t0
        try:
            ray.get(calls, timeout=PEER_WAIT_S)
        except BaseException as e:  # a peer lost or hung: the driver finds out from its own calls
            with self._cond:
                if not self._stale(gen.number):
                    self._error = e
                    self._cond.notify_all()

    # ------------------------------------------------------------------ snapshots

    def _take_snapshot(self, step: int) -> None:
        live = self.store.flat_state()
        tensors = self._snapshot.tensors if self._snapshot else {k: torch.empty_like(v) for k, v in live.items()}
        for name, buf in live.items():
            tensors[name].copy_(buf)
        self._snapshot = Snapshot(step, tensors, {u: opt.step_count() for u, opt in self.optimizers.items()})

    def _restore_snapshot(self, step: int) -> int:
        """Back to the snapshot; returns its step (`step` where there is none: a shard of frozen units
        alone takes none, its state never changes)."""
        if self._snapshot is None:
            return step
        self.store.load_flat_state(self._snapshot.tensors)
        for unit, count in self._snapshot.adam_counts.items():
            self.optimizers[unit].set_step(count)
        return self._snapshot.step

    def _stale(self, generation: int) -> bool:
        return self.gen is None or generation != self.gen.number or self.gen.stopped

    def _raise_if_stale(self, generation: int) -> None:
        if self._stale(generation):
            raise StaleGenerationError(f"generation {generation} was stopped")
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise ClusterError("a coordinator shard's sum or optimizer failed") from self._error
