"""A coordinator shard: one per node, holding the fp32 master weights and Adam moments of its part.

The model is cut into contiguous parts (mt_ray.cluster.partition), one per node. Each node's
shard plays two roles:
- **node reducer.** The node's workers hand it every unit gradient through the node's object
  store. Once all local workers' gradients of a unit are in, it sums them in fp32 (rank order),
  and sends that one partial sum to the unit's owner, or keeps it when it owns the unit itself:
  each node's gradients cross the network once. A node with one worker has nothing to sum: its
  worker's object itself goes on to the owner.
- **owner.** For its own units it adds the nodes' partial sums (node order), hands the sum to
  the engine's `OptimizerWorker` (a lone contribution, one node with one worker, is handed
  over as it is: the sum of one gradient is that gradient), and after each update publishes the unit's compute-dtype
  weights in its object store, from which every node pulls one copy for its workers.
A frozen unit (an image-text model's vision tower, by default) is published once per generation
and never waited on: no gradient comes for it, it has no moments and is never updated. A vision
unit that no worker's rows used in a step (no image anywhere in the batch) arrives as None from
every worker: like torch with a None gradient, it is left as it is, Adam count included.
With clipping, the driver gathers each shard's norm² of its summed units and hands the global
norm back (`apply_norm`); no unit is updated before every gradient of the step is in.

Sums run on one reduce thread and Adam on the optimizer thread, with the intra-op thread count
set once for the process (it is process-wide: Ray starts actors with OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError

from mt_ray.cluster.errors import ClusterError, StaleGenerationError
from mt_ray.cluster.grad_pool import GradPool
from mt_ray.cluster.node_memory import NodeMemoryPeak
from mt_ray.cluster.partition import ShardPlan
from mt_ray.cluster.wire import from_numpy, sum_in_order, to_numpy
from mt_ray.engine.config import EngineConfig, OptimizerConfig
from mt_ray.engine.host_store import HostStore, peak_rss_bytes
from mt_ray.engine.optimizer import UnitOptimizer, counts_behind, lr_at, restore_counts
from mt_ray.engine.optimizer_worker import OptimizerWorker
from mt_ray.models.discovery import discover
from mt_ray.models.weights import init_random, load_safetensors

_WAKE_ALL = 1 << 62  # a version no unit reaches: wakes threads blocked on a retired optimizer worker
PUBLISH_THREADS = 2  # puts into the object store run on these, beside the optimizer
SHARD_BUFFERS = 2  # unit-sized buffers for sums and publication casts (GradPool)
GET_POLL_S = 1.0  # how often a read of a worker's gradient checks that its generation still runs


@dataclass
class _Published:
    version: int
    ref: ray.ObjectRef | None  # None once every worker has it mapped (a late reader gets a fresh copy)
    fetched: int = 0


@dataclass
class _Snapshot:
    """The flat state and each trained unit's Adam count after `step` steps: what a recovery restores."""

    step: int
    tensors: dict[str, torch.Tensor]
    adam_counts: dict[str, int]


@dataclass
class _Generation:
    """Everything one generation of workers may touch; a recovery or a restore starts a new one."""

    number: int
    step: int
    opt: OptimizerWorker
    local: dict[tuple[int, str], dict[int, ray.ObjectRef]] = field(default_factory=dict)
    remote: dict[tuple[int, str], dict[int, list[ray.ObjectRef] | np.ndarray]] = field(default_factory=dict)
    norms: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    forwarded: dict[int, list[ray.ObjectRef]] = field(default_factory=dict)
    summed: dict[tuple[int, str], threading.Event] = field(default_factory=dict)  # set once a unit's sum is done
    touched: set[int] = field(default_factory=set)
    ended: set[int] = field(default_factory=set)
    stopped: bool = False


def read_unless_stopped(gen: _Generation, ref: ray.ObjectRef) -> np.ndarray:
    """`ray.get(ref)`, given up (StaleGenerationError) once `gen` is stopped.

    A gradient object is owned by the worker that put it; should that worker die while the
    object is read, Ray may wait for it forever (ray-project/ray#63694), and `stop` waits for
    the reduce thread. Polling bounds that wait by the driver's decision to end the step.
    """
    while True:
        try:
            return ray.get(ref, timeout=GET_POLL_S)
        except GetTimeoutError:
            if gen.stopped:
                raise StaleGenerationError(f"generation {gen.number} was stopped while reading a gradient") from None


class CoordinatorShard:
    """A Ray actor with concurrent (threaded) calls; see the module docstring."""

    def __init__(self, model, engine_cfg: dict, opt_cfg: dict, total_steps: int, shard: int, num_shards: int,
                 num_local: int, num_workers: int, snapshot_every: int, freeze: dict[str, bool] | None = None):
        """`freeze`: the `discover` options the driver's spec was found with (an image-text model's freeze flags)."""
        self.node_memory = NodeMemoryPeak()  # before anything of the run is allocated here
        self.spec = discover(model, **(freeze or {}))
        self.cfg = EngineConfig(**engine_cfg)
        self.opt_cfg = OptimizerConfig(**opt_cfg)
        self.threads = self.cfg.optimizer_thread_count
        torch.set_num_threads(self.threads)  # once, for every thread of this process
        self.total_steps = total_steps
        self.shard, self.num_shards = shard, num_shards
        self.num_local, self.num_workers = num_local, num_workers
        self.snapshot_every = snapshot_every
        self.plan = ShardPlan.build(self.spec, num_shards)
        self.owned = self.plan.units_of(shard)
        self.owned_names = [u.name for u in self.owned]
        self.trained = [u.name for u in self.owned if not u.frozen]  # the units gradients come for
        self.frozen = {u.name for u in self.owned if u.frozen}
        self.numels = {u.name: u.numel for u in self.spec.units}
        self.clips = self.opt_cfg.max_grad_norm > 0
        self.grad_dtype = self.cfg.grad_torch_dtype  # gradients travel and wait in this dtype
        # The configured limit is checked per node against the whole plan by the driver (check_plan).
        self.store = HostStore(self.spec, None, False, 0, None, units=self.owned)
        self.optimizers = {name: UnitOptimizer(self.store, self.spec.unit(name), self.opt_cfg) for name in self.trained}
        self.pool = GradPool(self.numels, self.grad_dtype, SHARD_BUFFERS, cast_dtype=self.cfg.dtype)
        self._publisher = ThreadPoolExecutor(PUBLISH_THREADS, thread_name_prefix="mt-ray-publish")
        self._reducer = ThreadPoolExecutor(1, thread_name_prefix="mt-ray-reduce")
        self.peers: list = []
        self._cond = threading.Condition()
        self._published: dict[str, _Published] = {}
        self._snapshot: _Snapshot | None = None
        self._error: BaseException | None = None
        self.gen: _Generation | None = None
        self.seconds = {"sum": 0.0, "publish": 0.0, "adam": 0.0}  # busy time, for the benchmark's time split

    def set_peers(self, peers: list) -> None:
        """Every shard's handle, by shard index (partial sums go to their unit's owner)."""
        self.peers = peers

    # ------------------------------------------------------------------ weights in and out

    def load_random(self, seed: int = 0) -> None:
        init_random(self.spec, self._load_owned, seed, "cpu")  # every unit, so the RNG stream matches one engine

    def load_pretrained(self, folder: str) -> None:
        load_safetensors(self.spec, folder, self._load_owned)

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        for unit in self.owned:
            self.store.load_named(unit, {k: from_numpy(a, torch.float32) for k, a in state.items()})

    def _load_owned(self, unit, tensors: dict[str, torch.Tensor]) -> None:
        if unit.name in self.owned_names:
            self.store.load_named(unit, tensors)

    # The readers below run between steps, once `wait_updated` has returned: nothing is updating.

    def state_part(self) -> dict[str, np.ndarray]:
        """fp32 master weights of this shard's units, by Hugging Face name."""
        return {k: to_numpy(v) for k, v in self.store.state_dict().items()}

    def write_checkpoint_part(self, writer, pieces: dict[str, list], starts: dict[str, int], io_workers: int) -> dict:
        """Store this shard's pieces of the flat master/moment tensors (its range of each begins at `starts[name]`)."""
        from mt_ray.tracking.ckpt_format import ShardSource  # tracking is needed only when checkpointing

        flat = self.store.flat_state()
        sources = [ShardSource(p.file, name, p.start, flat[name][p.start - starts[name]:p.start - starts[name] + p.numel])
                   for name, ps in pieces.items() for p in ps]
        with ThreadPoolExecutor(io_workers, thread_name_prefix="ckpt-write") as io:
            return dict(zip([s.file for s in sources], io.map(writer.write_file, sources), strict=True))

    def read_checkpoint_part(self, stored, starts: dict[str, int]) -> None:
        """Read this shard's range of a stored checkpoint (cut for any number of shards) into its state;
        `starts`: where the range begins in each flat tensor. Adam counts become the checkpoint's, as the
        single engine's do."""
        for name, buf in self.store.flat_state().items():
            stored.read_range(name, starts[name], starts[name] + buf.numel(), buf)
        meta = stored.manifest.meta
        restore_counts(self.optimizers, meta["step"], meta.get("adam_counts", {}))

    def adam_counts_behind(self, step: int) -> dict[str, int]:
        """This shard's units whose Adam count is not `step` (`counts_behind`), for a checkpoint's meta."""
        return counts_behind(self.optimizers, step)

    def host_bytes(self) -> dict[str, int]:
        """Peak growth of this node's used memory since the shard started, and this process's peak RSS."""
        return {"node_growth": self.node_memory.growth, "shard_rss_peak": peak_rss_bytes()}

    # ------------------------------------------------------------------ generations

    def start(self, generation: int, step: int, restore_snapshot: bool = False) -> int:
        """Begin `generation` at `step`: retire the last one's optimizer, publish the weights of `step`.

        With `restore_snapshot`, the state (Adam counts included) first goes back to the snapshot; returns its
        step. Otherwise the counts stay: they are the updates each unit has had (a vision unit skips steps
        without images), whether `step` redoes a stopped step or follows a completed one.
        """
        old = self.gen
        if old is not None:
            old.opt.close()
            self.seconds["adam"] += old.opt.busy_seconds  # applies what was queued (an ended step's updates, or unclipped ones)
            old.opt.reset_versions(_WAKE_ALL)  # its publish loop wakes, sees the generation is over, exits
            self.pool.clear()
        if restore_snapshot:
            step = self._restore_snapshot(step)
        opt_worker = OptimizerWorker(self.store, self.optimizers, self.pool, self.trained,
                                     self.opt_cfg.max_grad_norm, self.threads, grads_read_only=True)
        opt_worker.reset_versions(step)
        with self._cond:
            self.gen = _Generation(generation, step, opt_worker)
            self._published.clear()
            self._error = None
        if self.snapshot_every and self.trained and (self._snapshot is None or step % self.snapshot_every == 0):
            self._take_snapshot(step)
        for unit in self.owned_names:
            self._publish(self.gen, unit, step)
        threading.Thread(target=self._publish_loop, args=(self.gen,), name="mt-ray-publish-loop", daemon=True).start()
        return step

    def stop(self, step: int) -> dict:
        """Refuse this generation's calls from now on (a worker was lost in `step`); report what `step` reached.

        complete: every gradient of this shard's units is summed (with `norm_sq`); touched: some
        unit was updated (only without clipping, where units update as their sums land).
        """
        with self._cond:
            gen = self.gen
            gen.stopped = True
            self._cond.notify_all()
            waiting = list(gen.summed.values())
        for event in waiting:  # workers of this generation waiting on a sum that will not come
            event.set()
        self._reducer.submit(lambda: None).result()  # sums already queued have finished
        norms = gen.norms.get(step, {})
        complete = step in gen.ended or len(norms) == len(self.trained)
        return {"complete": complete, "touched": step in gen.touched,
                "norm_sq": self._norm_total(norms) if complete and step not in gen.ended else None,
                "snapshot_step": self._snapshot.step if self._snapshot else None}

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

    def ping(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def close(self) -> None:
        self.node_memory.close()
        if self.gen is not None:
            self.gen.opt.close()
        self._publisher.shutdown(wait=False)
        self._reducer.shutdown(wait=False)

    # ------------------------------------------------------------------ workers' calls

    def get_weights(self, generation: int, unit: str, version: int) -> list[ray.ObjectRef]:
        """The object holding `unit`'s compute-dtype weights after `version` steps, once published.

        Returned inside a list so Ray hands the worker the reference, not a copy of the value.
        Once every worker has fetched a version, the shard lets go of it: the store frees it as
        soon as the workers' backward passes are done with it. A frozen unit's one object serves
        every version and is kept for the whole generation.
        """
        frozen = unit in self.frozen
        with self._cond:
            self._cond.wait_for(lambda: self._stale(generation) or self._error is not None or (
                unit in self._published and (frozen or self._published[unit].version >= version)))
            self._raise_if_stale(generation)
            pub = self._published[unit]
            if frozen:
                return [pub.ref]
            if pub.version != version:
                raise ClusterError(f"a worker asked for {unit} after {version} steps; the shard holds {pub.version}")
            ref = pub.ref
            pub.fetched += 1
            if pub.fetched >= self.num_workers:
                pub.ref = None
        if ref is None:  # a replacement worker, after the others let go of this version
            ref = ray.put(to_numpy(self.store.master_of(unit).to(self.cfg.dtype)))
        return [ref]

    def put_grad(self, generation: int, step: int, rank: int, unit: str, grad: list[ray.ObjectRef | None]) -> None:
        """One local worker's gradient of `unit`: `[ref]` to the object it put in this node's store
        (in a list, so Ray hands over the reference, which a lone gradient is passed on as), or
        `[None]`: its rows did not use the unit (a vision unit, and no image among them).

        Returns once it has been summed, so a worker that bounds its unanswered calls bounds
        the gradients it keeps in the object store.
        """
        with self._cond:
            if self._stale(generation):
                return
            gen = self.gen
            summed = gen.summed.setdefault((step, unit), threading.Event())
            got = gen.local.setdefault((step, unit), {})
            [got[rank]] = grad
            if len(got) == self.num_local:
                del gen.local[(step, unit)]
                self._on_local_sum(gen, step, unit, got)
        del grad, got
        summed.wait()
        self._raise_if_failed()

    def put_partial(self, generation: int, step: int, node: int, unit: str, partial: list[ray.ObjectRef | None]) -> None:
        """Another node's sum of its workers' gradients of a unit this shard owns, as `[ref]` (`[None]`: none of
        them used the unit).

        Fetched here, on this call's thread, so partials from several nodes arrive at once, as Ray
        fetches task arguments; but where a dying owner cannot hang the fetch (`read_unless_stopped`).
        """
        with self._cond:
            if self._stale(generation):
                return
            gen = self.gen
        try:
            array = None if partial[0] is None else read_unless_stopped(gen, partial[0])
        except StaleGenerationError:
            return
        with self._cond:
            if gen is self.gen and not gen.stopped:
                self._add_contribution(gen, step, unit, node, array)

    def local_norm_sq(self, generation: int, step: int) -> float:
        """Once every unit of this shard is summed for `step` (and partials sent on have arrived): its norm²."""
        with self._cond:
            self._cond.wait_for(lambda: self._stale(generation) or self._error is not None
                                or len(self.gen.norms.get(step, {})) == len(self.trained))
            self._raise_if_stale(generation)
            gen = self.gen
        ray.get(gen.forwarded.pop(step, []))  # the owners have our partial sums (surfaces their errors)
        return self._norm_total(gen.norms.get(step, {}))  # a shard of frozen units alone has none

    def apply_norm(self, step: int, norm_sq: float) -> None:
        """The step's global norm² (from every shard): the clipped updates of this shard's units begin."""
        gen = self.gen
        gen.norms.pop(step, None)
        gen.ended.add(step)
        gen.opt.end_step(torch.tensor(norm_sq, dtype=torch.float32), None, lr_at(step, self.opt_cfg, self.total_steps))

    # ------------------------------------------------------------------ sums

    def _on_local_sum(self, gen: _Generation, step: int, unit: str, got: dict[int, ray.ObjectRef]) -> None:
        """Every local worker's gradient of `unit` is in (lock held): sum and send on, or add as this node's part."""
        refs = [got[r] for r in sorted(got) if got[r] is not None]  # None: that worker's rows did not use the unit
        owner = self.plan.owner(unit)
        if owner == self.shard:
            self._add_contribution(gen, step, unit, self.shard, refs)
        elif len(refs) <= 1:  # nothing to sum: the worker's object (or None) goes on as this node's partial
            gen.forwarded.setdefault(step, []).append(
                self.peers[owner].put_partial.remote(gen.number, step, self.shard, unit, refs[:1] or [None]))
            gen.summed.pop((step, unit)).set()
        else:
            self._reducer.submit(self._guarded, gen, step, unit, self._forward_partial, owner, refs)

    def _add_contribution(self, gen: _Generation, step: int, unit: str, node: int, part) -> None:
        """A node's contribution to an owned unit (lock held); the last one starts the sum."""
        gen.summed.setdefault((step, unit), threading.Event())
        got = gen.remote.setdefault((step, unit), {})
        got[node] = part
        if len(got) < self.num_shards:
            return
        del gen.remote[(step, unit)]
        # Node order, each node's workers in rank order: the sum never depends on arrival order.
        ordered = [a for n in range(self.num_shards) for a in (got[n] if isinstance(got[n], list) else [got[n]])
                   if a is not None]
        if not ordered:  # no worker's rows used the unit
            self._reducer.submit(self._guarded, gen, step, unit, self._skip_owned)
        elif len(ordered) == 1:  # one worker's object is the gradient
            self._reducer.submit(self._guarded, gen, step, unit, self._keep_owned, ordered[0])
        else:
            self._reducer.submit(self._guarded, gen, step, unit, self._sum_owned, ordered)

    def _guarded(self, gen: _Generation, step: int, unit: str, fn: Callable, *args) -> None:
        """Run one sum on the reduce thread; whatever happens, the workers waiting on it wake."""
        t0 = time.perf_counter()
        try:
            fn(gen, step, unit, *args)
            self.seconds["sum"] += time.perf_counter() - t0
        except BaseException as e:
            with self._cond:
                self._error = self._error or e
                self._cond.notify_all()
        finally:
            with self._cond:
                event = gen.summed.pop((step, unit), None)
            if event is not None:
                event.set()

    def _arrays(self, gen: _Generation, parts: list[ray.ObjectRef | np.ndarray]) -> list[tuple[np.ndarray, torch.dtype]]:
        """Read-only views of local objects (by reference) and of other nodes' sums (as fetched)."""
        return [(read_unless_stopped(gen, p) if isinstance(p, ray.ObjectRef) else p, self.grad_dtype) for p in parts]

    def _forward_partial(self, gen: _Generation, step: int, unit: str, owner: int, refs: list[ray.ObjectRef]) -> None:
        i, buf = self.pool.acquire(unit)
        try:
            sum_in_order(self._arrays(gen, refs), buf)
            ref = ray.put(to_numpy(buf))  # the one copy of this node's gradient that crosses the network
        finally:
            self.pool.give_back(i)
        call = self.peers[owner].put_partial.remote(gen.number, step, self.shard, unit, [ref])
        with self._cond:
            gen.forwarded.setdefault(step, []).append(call)

    def _sum_owned(self, gen: _Generation, step: int, unit: str, parts: list) -> None:
        i, buf = self.pool.acquire(unit)
        norm_sq = sum_in_order(self._arrays(gen, parts), buf)
        del parts  # the workers' and nodes' objects can be freed now
        # With clipping the sum waits for the global norm in the object store, not in this process.
        grad = self.pool.hold(unit, i) if self.clips else self.pool.lend(unit, i)
        self._to_optimizer(gen, step, unit, grad, norm_sq)

    def _keep_owned(self, gen: _Generation, step: int, unit: str, ref: ray.ObjectRef) -> None:
        """The lone worker's object is the unit's gradient: kept, not copied, until the optimizer is done."""
        array = read_unless_stopped(gen, ref)  # a read-only view of this node's store
        norm_sq = sum_in_order([(array, self.grad_dtype)], None)
        self._to_optimizer(gen, step, unit, self.pool.keep(unit, ref, array), norm_sq)

    def _skip_owned(self, gen: _Generation, step: int, unit: str) -> None:
        """No gradient anywhere (a vision unit in a step without images): like torch with a None `.grad`,
        the optimizer leaves the unit and its Adam count as they are; only its version advances."""
        self._to_optimizer(gen, step, unit, None, torch.zeros((), dtype=torch.float32))

    def _to_optimizer(self, gen: _Generation, step: int, unit: str, grad: torch.Tensor | None,
                      norm_sq: torch.Tensor) -> None:
        with self._cond:
            if gen.stopped:
                self.pool.release(unit)
                return
            gen.opt.submit(unit, grad, None, lr_at(step, self.opt_cfg, self.total_steps))
            if not self.clips:
                gen.touched.add(step)
            gen.norms.setdefault(step, {})[unit] = norm_sq
            self._cond.notify_all()

    def _norm_total(self, norms: dict[str, torch.Tensor]) -> float:
        # Summed in unit order, not arrival order, so a rerun clips with the same coefficient.
        return float(sum(norms[u].double() for u in self.trained))

    # ------------------------------------------------------------------ publishing

    def _publish_loop(self, gen: _Generation) -> None:
        """Publish each trained unit as soon as the optimizer has written its next version, forward order
        (frozen ones were published once, by `start`)."""
        version = gen.step + 1
        try:
            while self.trained:
                for unit in self.trained:
                    gen.opt.wait_updated(unit, version)
                    if self._stale(gen.number):
                        return
                    if unit == self.trained[-1] and self.snapshot_every and version % self.snapshot_every == 0:
                        # Before the last unit is out no worker can finish a forward pass, so no
                        # update of the next step can race with this copy. (A step without images
                        # reads no vision unit, but leaves every one as it is: vision units come
                        # first, so a shard whose last trained unit is one owns no other kind.)
                        self._take_snapshot(version)
                    self._publisher.submit(self._publish, gen, unit, version)
                version += 1
        except BaseException as e:  # the optimizer failed: fail the workers waiting for weights
            with self._cond:
                if not self._stale(gen.number):
                    self._error = e
                    self._cond.notify_all()

    def _publish(self, gen: _Generation, unit: str, version: int) -> None:
        """Cast the unit's master to the compute dtype and put it in the object store: one copy per node."""
        i, cast = self.pool.acquire(unit, self.cfg.dtype)
        t0 = time.perf_counter()
        try:
            ref = ray.put(to_numpy(cast.copy_(self.store.master_of(unit))))
        finally:
            self.pool.give_back(i)
        self.seconds["publish"] += time.perf_counter() - t0
        with self._cond:
            if gen is self.gen and not gen.stopped:
                self._published[unit] = _Published(version, ref)
                self._cond.notify_all()

    # ------------------------------------------------------------------ snapshots

    def _take_snapshot(self, step: int) -> None:
        live = self.store.flat_state()
        tensors = self._snapshot.tensors if self._snapshot else {k: torch.empty_like(v) for k, v in live.items()}
        for name, buf in live.items():
            tensors[name].copy_(buf)
        self._snapshot = _Snapshot(step, tensors, {u: opt.step_count() for u, opt in self.optimizers.items()})

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
