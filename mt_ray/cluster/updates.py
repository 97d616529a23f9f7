"""The optimizer's ownership of a shard's units: their fp32 state in the arena, each generation's optimizer thread,
the step's norms, clipping, and the snapshots a recovery restores. Owned by the coordinator shard
(mt_ray.cluster.shard); the node's sum (mt_ray.cluster.node_sum) hands it each owned unit's summed gradient.

With clipping, no unit is updated before every gradient of the step is in: the driver gathers each shard's norm² of
its summed units (or, with one worker in the run, the worker's own GPU norm, as the single engine takes it) and
hands the global norm back (`apply_norm`). Each update bumps the unit's version (`on_updated`, which the weight
exchange turns into the arena's version word and, with several nodes, a publication).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mt_ray.cluster.shard_state import Generation, ShardStatus, ShardUnits
from mt_ray.engine.config import OptimizerConfig
from mt_ray.engine.host_store import HostStore
from mt_ray.engine.optimizer import UnitOptimizer, lr_at
from mt_ray.engine.optimizer_worker import OptimizerWorker


@dataclass
class Snapshot:
    """The flat state and each trained unit's Adam count after `step` steps: what a recovery restores."""

    step: int
    tensors: dict[str, torch.Tensor]
    adam_counts: dict[str, int]


class GradSlots:
    """The `buffers` surface the optimizer releases gradients through: the arena's slots, reused every step."""

    def __init__(self, numels: dict[str, int]):
        self.numels = numels

    def release(self, unit: str) -> None:
        """Nothing to free: a slot is written again only after the unit's next upload, which waits for this update."""


class UnitUpdates:
    """Adam over the shard's trained units, on one optimizer thread per generation with `threads` intra-op
    threads. `on_updated(gen, unit, version)` runs on that thread as each unit reaches a version."""

    def __init__(self, units: ShardUnits, store: HostStore, opt_cfg: OptimizerConfig, total_steps: int,
                 threads: int, snapshot_every: int, status: ShardStatus,
                 on_updated: Callable[[Generation, str, int], None]):
        self.units = units
        self.store = store
        self.opt_cfg = opt_cfg
        self.total_steps = total_steps
        self.threads = threads
        self.snapshot_every = snapshot_every
        self.status = status
        self.on_updated = on_updated
        self.clips = opt_cfg.max_grad_norm > 0
        self.optimizers = {name: UnitOptimizer(store, units.spec.unit(name), opt_cfg) for name in units.trained}
        self.slots = GradSlots({u.name: u.numel for u in units.spec.trainable_units})
        self.snapshot: Snapshot | None = None
        self.retired_s = 0.0  # busy time of the retired generations' optimizers

    def begin(self, gen: Generation, restore_snapshot: bool) -> int:
        """Start `gen`'s optimizer at `gen.step` (after the snapshot's step, restored first, with
        `restore_snapshot`); returns the step it starts at. The last generation's is retired by the caller."""
        step = self._restore_snapshot(gen.step) if restore_snapshot else gen.step
        gen.step = step
        gen.updates.opt = OptimizerWorker(self.store, self.optimizers, self.slots, list(self.units.trained),
                                          self.opt_cfg.max_grad_norm, self.threads,
                                          on_advance=lambda unit, version: self._on_advance(gen, unit, version),
                                          on_error=self.status.fail)
        gen.updates.opt.reset_versions(step)
        if self.snapshot_every and self.units.trained and (self.snapshot is None or step % self.snapshot_every == 0):
            self._take_snapshot(step)
        return step

    def retire(self, gen: Generation) -> None:
        """Apply what `gen`'s optimizer still has queued (an ended step's updates, or unclipped ones); stop it."""
        gen.updates.opt.close()
        self.retired_s += gen.updates.opt.busy_seconds

    def submit(self, gen: Generation, step: int, unit: str, grad: torch.Tensor | None,
               norm_sq: torch.Tensor | None) -> None:
        """Queue an owned unit's update from its summed gradient; `norm_sq` None: its norm is the lone worker's
        GPU's."""
        with self.status.cond:
            if gen.stopped:
                return
            gen.updates.opt.submit(unit, grad, None, lr_at(step, self.opt_cfg, self.total_steps))
            if not self.clips:
                gen.updates.touched.add(step)
            gen.updates.norms.setdefault(step, {})[unit] = norm_sq
            self.status.cond.notify_all()

    def summed(self, gen: Generation, step: int) -> set[str]:
        """Trained units whose sum of `step` is in (lock held)."""
        if step in gen.updates.ended:
            return set(self.units.trained)
        return set(gen.updates.norms.get(step, {}))

    def norm_total(self, norms: dict[str, torch.Tensor | None]) -> float:
        # Summed in unit order, not arrival order, so a rerun clips with the same coefficient.
        return float(sum(norms[u].double() for u in self.units.trained if norms.get(u) is not None))

    def apply_norm(self, gen: Generation, step: int, norm_sq: float) -> None:
        """The step's global norm² (from every shard): the clipped updates of this shard's units begin."""
        gen.updates.norms.pop(step, None)
        gen.updates.ended.add(step)
        gen.updates.opt.end_step(torch.tensor(norm_sq, dtype=torch.float32), None,
                                 lr_at(step, self.opt_cfg, self.total_steps))

    def wait_updated(self, gen: Generation, version: int) -> None:
        """Block until every trained unit has had `version` optimizer steps (the optimizer's own bound)."""
        for unit in self.units.trained:
            gen.updates.opt.wait_updated(unit, version)

    def busy_seconds(self, gen: Generation | None) -> float:
        return self.retired_s + (gen.updates.opt.busy_seconds if gen is not None else 0.0)

    def _on_advance(self, gen: Generation, unit: str, version: int) -> None:
        """On the optimizer thread, as `unit` reaches `version`.

        The last trained unit to reach a snapshot's version takes the snapshot before its version is
        out: until then no worker can finish the next forward pass, so no update of the next step can
        race with the copy.
        """
        trained = len(self.units.trained)
        with self.status.cond:
            count = gen.updates.advanced[version] = gen.updates.advanced.get(version, 0) + 1
            if count == trained:
                del gen.updates.advanced[version]
        if count == trained and self.snapshot_every and version % self.snapshot_every == 0:
            self._take_snapshot(version)
        self.on_updated(gen, unit, version)

    def _take_snapshot(self, step: int) -> None:
        live = self.store.flat_state()
        tensors = self.snapshot.tensors if self.snapshot else {k: torch.empty_like(v) for k, v in live.items()}
        for name, buf in live.items():
            tensors[name].copy_(buf)
        self.snapshot = Snapshot(step, tensors, {u: opt.step_count() for u, opt in self.optimizers.items()})

    def _restore_snapshot(self, step: int) -> int:
        """Back to the snapshot; returns its step (`step` where there is none: a shard of frozen units
        alone takes none, its state never changes)."""
        if self.snapshot is None:
            return step
        self.store.load_flat_state(self.snapshot.tensors)
        for unit, count in self.snapshot.adam_counts.items():
            self.optimizers[unit].set_step(count)
        return self.snapshot.step
