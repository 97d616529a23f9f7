"""The coordinator: fp32 master weights and Adam state of a data-parallel run, in host memory.

Workers hand each finished unit gradient over through the object store (on a run over several
nodes, each node's reducer hands over its workers' sum instead). Once every gradient of a unit is in, the coordinator sums them in fp32, in rank order (so the result does
not depend on arrival order), and passes the sum to the engine's own `OptimizerWorker`, which
updates the unit while the workers' backward pass goes on. With clipping, the clip coefficient
comes from the norm of the summed gradient. After each update a publisher thread puts the
unit's compute-dtype weights in the object store, where workers read them zero-copy.

A failed step is ended by `recover`, and a checkpoint is restored by `load_checkpoint_state`:
either way a new generation of workers starts, and anything an old worker still sends is dropped.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import ray
import torch

from mt_ray.cluster.errors import ClusterError, StaleGenerationError
from mt_ray.cluster.wire import from_numpy, sum_fp32, to_numpy
from mt_ray.engine.config import EngineConfig, OptimizerConfig
from mt_ray.engine.host_store import HostStore
from mt_ray.engine.optimizer import UnitOptimizer, lr_at
from mt_ray.engine.optimizer_worker import OptimizerWorker
from mt_ray.engine.transfer import GradBuffers
from mt_ray.models.discovery import discover
from mt_ray.models.weights import init_random, load_safetensors

_WAKE_ALL = 1 << 62  # a version no unit reaches: wakes threads blocked on a retired optimizer worker


@dataclass
class _Snapshot:
    step: int
    tensors: dict[str, torch.Tensor]  # copies of the store's flat_state()


class Coordinator:
    """Owns the training state of one run; a Ray actor with concurrent (threaded) calls."""

    def __init__(self, model, engine_cfg: dict, opt_cfg: dict, total_steps: int, num_senders: int,
                 snapshot_every: int, node_sums: bool = False):
        """`num_senders` gradients of each unit make a step: the workers' own, or with `node_sums`
        the fp32 sums of the node reducers (mt_ray.cluster.reducer), one per node."""
        self.spec = discover(model)
        self.cfg = EngineConfig(**engine_cfg)
        self.opt_cfg = OptimizerConfig(**opt_cfg)
        self.total_steps = total_steps
        self.num_senders = num_senders
        self.snapshot_every = snapshot_every
        self.unit_order = [u.name for u in self.spec.units]
        self.numels = {u.name: u.numel for u in self.spec.units}
        self.clips = self.opt_cfg.max_grad_norm > 0
        self.wire_dtype = torch.float32 if node_sums else self.cfg.grad_torch_dtype
        copy_dtype = None if self.cfg.dtype == torch.float32 else self.cfg.dtype
        grad_bytes = 4 * (sum(self.numels.values()) if self.clips else 3 * max(self.numels.values()))
        self.store = HostStore(self.spec, copy_dtype, False, grad_bytes, self.cfg.host_memory_limit_gb)
        self.optimizers = {u.name: UnitOptimizer(self.store, u, self.opt_cfg) for u in self.spec.units}
        self.generation = 0
        self._cond = threading.Condition()
        self._published: dict[str, tuple[int, ray.ObjectRef]] = {}
        self._snapshot: _Snapshot | None = None
        self._error: BaseException | None = None
        self.opt_worker: OptimizerWorker | None = None

    # ------------------------------------------------------------------ weights in and out

    def load_random(self, seed: int = 0) -> None:
        init_random(self.spec, self.store.load_named, seed, "cpu")

    def load_pretrained(self, folder: str) -> None:
        load_safetensors(self.spec, folder, self.store.load_named)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for unit in self.spec.units:
            self.store.load_named(unit, state)

    # The readers below run between steps, once `wait_updated` has returned: nothing is updating.
    # Arrays, not tensors: a numpy view pickles only its own bytes and is mapped zero-copy on arrival.

    def state_dict(self) -> dict[str, np.ndarray]:
        """fp32 master weights by Hugging Face name."""
        return {k: to_numpy(v) for k, v in self.store.state_dict().items()}

    def checkpoint_state(self) -> dict[str, np.ndarray]:
        """The flat fp32 master and moment buffers (the engine's checkpoint tensors, same layout)."""
        return {k: to_numpy(v) for k, v in self.store.flat_state().items()}

    def load_checkpoint_state(self, tensors: dict[str, np.ndarray], meta: dict) -> int:
        """Restore a checkpoint (a data-parallel run's or a single engine's) and publish its weights.

        Returns the new generation, which the workers rejoin at `meta["step"]`.
        """
        self.store.layout.check_matches(meta["layout"])
        self._end_generation()
        self._snapshot = None  # a snapshot from before the restore must never be restored after it
        self._set_state({k: from_numpy(a, torch.float32) for k, a in tensors.items()}, meta["step"])
        with self._cond:
            self._start_generation(meta["step"])
            return self.generation

    def rss_bytes_per_param(self) -> float:
        return self.store.rss_bytes_per_param()

    def start(self, step: int = 0) -> int:
        """Publish the weights of `step` and accept gradients; returns the generation workers use."""
        with self._cond:
            self._start_generation(step)
            return self.generation

    def wait_updated(self, version: int) -> None:
        """Block until every unit has had `version` optimizer steps."""
        for unit in self.unit_order:
            self.opt_worker.wait_updated(unit, version)

    # ------------------------------------------------------------------ called by workers

    def get_weights(self, generation: int, unit: str, version: int) -> list[ray.ObjectRef]:
        """The object holding `unit`'s compute-dtype weights after `version` steps, once published.

        Returned inside a list so Ray hands the worker the reference, not a copy of the value.
        """
        with self._cond:
            self._cond.wait_for(lambda: generation != self.generation or self._error is not None
                                or self._published.get(unit, (-1,))[0] >= version)
            self._raise_if_stale(generation)
            v, ref = self._published[unit]
        if v != version:
            raise ClusterError(f"worker asked for {unit} after {version} steps, coordinator holds {v}")
        return [ref]

    def put_grad(self, generation: int, step: int, rank: int, unit: str, grad: np.ndarray) -> float | None:
        """One worker's gradient of `unit` for `step` (a read-only view of the object store).

        Returns the step's global gradient norm from the one call whose gradient completed the
        step (so the driver learns it with the workers' answers, at no extra round trip), else None.
        """
        with self._cond:
            if generation != self.generation:
                return None  # a worker of an aborted generation: its step is being redone
            got = self._arrived.setdefault((step, unit), {})
            got[rank] = grad
            if len(got) < self.num_senders:
                return None
            del self._arrived[(step, unit)]
            buffers = self.grad_buffers
        out = buffers.acquire(unit)  # may block until the optimizer frees a slab (no clipping)
        summed = sum_fp32([got[r] for r in range(self.num_senders)], self.wire_dtype, out)
        del got  # the workers' objects can be freed now
        norm_sq = torch.linalg.vector_norm(summed).square()
        with self._cond:
            if generation != self.generation:
                return None
            lr = lr_at(step, self.opt_cfg, self.total_steps)
            self.opt_worker.submit(unit, summed, None, lr)
            self._touched.add(step)
            norms = self._norm_sq.setdefault(step, {})
            norms[unit] = norm_sq
            return self._end_step(step, norms, lr) if len(norms) == len(self.unit_order) else None

    def _end_step(self, step: int, norms: dict[str, torch.Tensor], lr: float) -> float:
        # Summed in unit order, not arrival order, so a rerun clips with the same coefficient.
        total = torch.zeros((), dtype=torch.float32)
        for unit in self.unit_order:
            total += norms[unit]
        del self._norm_sq[step]
        self.opt_worker.end_step(total, None, lr)
        self._ended.add(step)
        return float(total.sqrt())

    # ------------------------------------------------------------------ failure

    def recover(self, failed_step: int) -> tuple[int, int, str]:
        """End `failed_step` after a lost worker: (step to resume from, new generation, what was done).

        With clipping no unit is updated before every gradient of the step is in, so the step
        is simply redone; a step whose gradients were all in completes; otherwise (no clipping,
        some units already updated) the last snapshot is restored and the steps since it replayed.
        """
        self._end_generation()  # a step whose gradients were all in completes
        if failed_step in self._ended:
            resume, how = failed_step + 1, "step had every gradient; completed"
        elif self.clips or failed_step not in self._touched:
            resume, how = failed_step, "no unit updated; step redone"
        else:
            resume, how = self._restore_snapshot(failed_step), "units partly updated; restored snapshot"
        with self._cond:
            self._start_generation(resume)
            return resume, self.generation, how

    def _restore_snapshot(self, failed_step: int) -> int:
        snap = self._snapshot
        if snap is None:
            raise ClusterError(
                f"step {failed_step} was partly applied when a worker was lost and there is no snapshot; "
                "set cluster.snapshot_every > 0 (or enable clipping, whose steps are all-or-nothing)"
            )
        self._set_state(snap.tensors, snap.step)
        return snap.step

    def _set_state(self, tensors: dict[str, torch.Tensor], step: int) -> None:
        """Master, moments and optimizer step counts as they were after `step` steps."""
        self.store.load_flat_state(tensors)
        for opt in self.optimizers.values():
            opt.set_step(step)

    def units_summed(self, step: int) -> int:
        """How many units of `step` have every worker's gradient in (for monitoring and tests)."""
        with self._cond:
            if step in self._ended:
                return len(self.unit_order)
            return len(self._norm_sq.get(step, {}))

    def ping(self) -> int:
        return self.generation

    def close(self) -> None:
        if self.opt_worker is not None:
            self.opt_worker.close()

    # ------------------------------------------------------------------ generations and publishing

    def _end_generation(self) -> None:
        """Refuse the current workers' calls from now on and drain the optimizer's queued updates."""
        with self._cond:
            self.generation += 1
            self._cond.notify_all()
        old = self.opt_worker
        old.close()
        old.reset_versions(_WAKE_ALL)  # the old publisher wakes, sees its generation is over, exits

    def _start_generation(self, step: int) -> None:
        """Fresh optimizer worker and step bookkeeping at `step`; publishes the weights of `step`."""
        self.grad_buffers = GradBuffers(self.numels, torch.float32, False, per_unit=self.clips, slabs=3)
        self.opt_worker = OptimizerWorker(self.store, self.optimizers, self.grad_buffers, self.unit_order,
                                          self.opt_cfg.max_grad_norm, self.cfg.optimizer_thread_count)
        self.opt_worker.reset_versions(step)
        self._arrived: dict[tuple[int, str], dict[int, np.ndarray]] = {}
        self._norm_sq: dict[int, dict[str, torch.Tensor]] = {}
        self._touched: set[int] = set()
        self._ended: set[int] = set()
        self._published.clear()
        if self.snapshot_every and (self._snapshot is None or step % self.snapshot_every == 0):
            self._take_snapshot(step)
        for unit in self.unit_order:
            self._published[unit] = (step, ray.put(to_numpy(self.store.streamed_of(unit))))
        self._cond.notify_all()
        args = (self.generation, self.opt_worker, step + 1)
        threading.Thread(target=self._publish_loop, args=args, name="mt-ray-publish", daemon=True).start()

    def _publish_loop(self, generation: int, worker: OptimizerWorker, version: int) -> None:
        """Publish each unit as soon as the optimizer has written its next version, forward order."""
        try:
            while True:
                for unit in self.unit_order:
                    worker.wait_updated(unit, version)
                    if generation != self.generation:
                        return
                    if unit == self.unit_order[-1] and self.snapshot_every and version % self.snapshot_every == 0:
                        # Before the last unit is out no worker can finish a forward pass, so no
                        # update of the next step can race with this copy.
                        self._take_snapshot(version)
                    # One copy into shared memory; every worker on the node maps this same object.
                    ref = ray.put(to_numpy(self.store.streamed_of(unit)))
                    with self._cond:
                        if generation != self.generation:
                            return
                        self._published[unit] = (version, ref)
                        self._cond.notify_all()
                version += 1
        except BaseException as e:  # the optimizer failed: fail the workers waiting for weights
            with self._cond:
                if generation == self.generation:
                    self._error = e
                    self._cond.notify_all()

    def _take_snapshot(self, step: int) -> None:
        live = self.store.flat_state()
        if self._snapshot is None:
            self._snapshot = _Snapshot(step, {k: torch.empty_like(v) for k, v in live.items()})
        for name, buf in live.items():
            self._snapshot.tensors[name].copy_(buf)
        self._snapshot.step = step

    def _raise_if_stale(self, generation: int) -> None:
        if generation != self.generation:
            raise StaleGenerationError(f"generation {generation} was aborted (now {self.generation})")
        if self._error is not None:
            raise ClusterError("the coordinator's optimizer failed") from self._error
