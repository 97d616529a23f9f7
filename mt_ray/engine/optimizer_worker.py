"""The CPU thread that runs each unit's optimizer as soon as its gradient has landed.

Without clipping a unit is updated the moment its gradient arrives, overlapping the rest of
the backward pass. A unit the step did not use (a vision unit in a step without images) is
submitted without a gradient: like a parameter whose `.grad` is None in torch's AdamW, it is
left unchanged and its step count stays, but its version advances; so is each tensor of a unit that got no
gradient (`skip`, `UnitOptimizer.step`). Frozen units are not the
worker's: waiting on one returns at once. With clipping, gradients wait in their buffers until the step's global
norm is known; the worker then updates units in forward order, so the next step's forward can
start on the embedding and layer 0 while later layers are still being updated.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mt_ray.engine.host_adamw import use_threads
from mt_ray.engine.host_store import CHUNK_NUMEL, HostStore
from mt_ray.engine.optimizer import Spans, UnitOptimizer
from mt_ray.engine.transfer import GradBuffers

# How long a wait for an update may see no unit updated at all before it fails: far above any one unit's update
# (a 7B LM head from NVMe takes seconds) plus the GPU work a step may still have queued before its norm is known.
UPDATE_STALL_S = 600.0


@dataclass
class _Grad:
    unit: str
    grad: torch.Tensor | None  # None: the step did not use the unit; it is not updated
    landed: torch.cuda.Event | None
    lr: float
    skip: Spans = ()  # spans of the unit that got no gradient: left as they are


@dataclass
class _EndOfStep:
    norm_sq: torch.Tensor
    ready: torch.cuda.Event | None
    lr: float


class OptimizerWorker:
    """Owns the unit optimizers; the engine feeds it gradients and waits on unit versions."""

    def __init__(self, store: HostStore, optimizers: dict[str, UnitOptimizer], buffers: GradBuffers,
                 unit_order: list[str], max_grad_norm: float, threads: int | None, grads_read_only: bool = False,
                 on_advance: Callable[[str, int], None] | None = None,
                 on_error: Callable[[BaseException], None] | None = None):
        """`grads_read_only`: gradients are views the optimizer must not write (shared memory).
        `on_advance(unit, version)`: called on this thread as each unit reaches a new version (after its update),
        so a data-parallel shard can tell its workers at once; `on_error(e)`: called once should an update fail."""
        self.store = store
        self.optimizers = optimizers
        self.buffers = buffers
        self.unit_order = unit_order
        self.max_grad_norm = max_grad_norm
        self.threads = threads
        self.grads_read_only = grads_read_only
        self.on_advance = on_advance
        self.on_error = on_error
        self.version = dict.fromkeys(unit_order, 0)
        self.stall_s = UPDATE_STALL_S
        self._advances = 0  # units updated so far, all steps: what a bounded wait watches for progress
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._queue: queue.Queue[_Grad | _EndOfStep | None] = queue.Queue()
        self._pending: list[_Grad] = []
        self.last_clip_coef = 1.0
        self._scratch: torch.Tensor | None = None  # `_scratch_of`
        self.busy_seconds = 0.0  # CPU time spent updating, for the benchmark's time split
        self.device_seconds = 0.0  # time spent on the updates of units kept on the device (`device_state.py`)
        # Without clipping units update as their gradients land (the backward's order), with it in forward order:
        # a store whose state is on disk reads ahead in that order.
        store.expect_updates(list(unit_order) if self.clips else list(reversed(unit_order)))
        self._device_queue: queue.Queue[list[tuple[_Grad, float]] | None] = queue.Queue()
        self._device_thread: threading.Thread | None = None  # `_device_updates`
        self._thread = threading.Thread(target=self._run, name="mt-ray-optimizer", daemon=True)
        self._thread.start()

    @property
    def clips(self) -> bool:
        return self.max_grad_norm > 0

    copies_out = False  # the engine lands each gradient in this worker's buffers itself

    def submit(self, unit: str, grad: torch.Tensor | None, landed: torch.cuda.Event | None, lr: float,
               skip: Spans = ()) -> None:
        self._raise_if_failed()
        self._queue.put(_Grad(unit, grad, landed, lr, skip))

    def end_step(self, norm_sq: torch.Tensor, ready: torch.cuda.Event | None, lr: float) -> None:
        self._queue.put(_EndOfStep(norm_sq, ready, lr))

    def wait_updated(self, unit: str, version: int) -> None:
        """Block until `unit` has been updated `version` times (CPU-side wait only; a frozen unit never changes).

        Bounded: while the thread goes on updating units the wait goes on, but should no unit advance for
        `stall_s` seconds (a hung update, or a step whose gradients never came) it raises, naming the unit.
        """
        if unit not in self.version:
            return
        with self._cond:
            while self.version[unit] < version and self._error is None:
                seen = self._advances
                # Woken by every unit's update (`_advance`); a whole `stall_s` without one ends the wait.
                if not self._cond.wait(timeout=self.stall_s) and self._advances == seen:
                    raise RuntimeError(
                        f"the optimizer thread updated no unit for {self.stall_s:g} s while the engine waited for "
                        f"{unit} to reach step {version} (it holds step {self.version[unit]}): an update hung, or "
                        "a step did not hand over all its gradients (end_step)")
        self._raise_if_failed()

    def is_updated(self, unit: str, version: int) -> bool:
        """Whether `unit` has been updated `version` times already (never blocks)."""
        return unit not in self.version or self.version[unit] >= version

    def reset_versions(self, version: int) -> None:
        """After a checkpoint restore: every unit holds the weights of update `version`."""
        with self._cond:
            self.version = dict.fromkeys(self.unit_order, version)
            self._cond.notify_all()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        if self._device_thread is not None:  # after the thread that feeds it
            self._device_queue.put(None)
            self._device_thread.join()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError("the optimizer thread failed") from self._error

    def _run(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
            use_threads(self.threads)  # numba's team, for the host AdamW: its own count per thread
        try:
            while (item := self._queue.get()) is not None:
                self._handle(item)
        except BaseException as e:  # surfaced to the engine thread by wait_updated/submit
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        with self._cond:
            self._error = e
            self._cond.notify_all()
        if self.on_error is not None:
            self.on_error(e)

    def _handle(self, item: _Grad | _EndOfStep) -> None:
        if isinstance(item, _Grad):
            if self.clips:
                self._pending.append(item)
            else:
                self._update(item, 1.0)
            return
        if not self.clips:
            return
        if item.ready is not None:
            item.ready.synchronize()  # the norm's device->host copy has landed
        norm = float(item.norm_sq) ** 0.5
        # torch.nn.utils.clip_grad_norm_'s coefficient, so results match it exactly.
        coef = min(1.0, self.max_grad_norm / (norm + 1e-6))
        self.last_clip_coef = coef
        rank = {u: i for i, u in enumerate(self.unit_order)}
        ordered = sorted(self._pending, key=lambda g: rank[g.unit])
        self._pending.clear()
        # The device's units in one hand-over, before the host's pass starts: their kernels are queued at once.
        if on_device := [(g, coef) for g in ordered if self._kept(g)]:
            self._device_updates().put(on_device)
        for g in ordered:
            if not self._kept(g):
                self._update(g, coef)

    def _update(self, g: _Grad, coef: float) -> None:
        if g.grad is None:
            self._advance(g.unit)
            return
        if self._kept(g):
            self._device_updates().put([(g, coef)])  # beside the host's pass, not before it
            return
        if g.landed is not None:
            g.landed.synchronize()  # this gradient's device->host copy is complete
        t0 = time.perf_counter()
        self.optimizers[g.unit].step(g.grad, g.lr, coef, self._scratch_of, self.grads_read_only,  # refreshes the copy
                                     g.skip)
        self.buffers.release(g.unit)
        self.busy_seconds += time.perf_counter() - t0
        self._advance(g.unit)

    def _kept(self, g: _Grad) -> bool:
        """Whether `g`'s unit is updated on the device (its state kept there), by `_run_device`."""
        return g.grad is not None and self.store.kept_on_device(g.unit)

    def _device_updates(self) -> queue.Queue[list[tuple[_Grad, float]] | None]:
        """The queue of the thread that updates the units kept on the device (`HostStore.keep_on_device`), started
        on first use: their kernels run while this thread goes on with the host's units, so the host's pass starts
        the moment the norm is known."""
        if self._device_thread is None:
            self._device_thread = threading.Thread(target=self._run_device, name="mt-ray-device-optimizer", daemon=True)
            self._device_thread.start()
        return self._device_queue

    def _run_device(self) -> None:
        """Queue each waiting update's kernels (a few Python calls a unit) and hand each unit over as soon as its
        kernels have run, checking between launches: the first unit (the embedding, which the next forward waits
        for) goes out while the later ones are still being queued."""
        try:
            while True:
                batches = [self._device_queue.get()]
                while not self._device_queue.empty():
                    batches.append(self._device_queue.get_nowait())
                t0 = time.perf_counter()
                kept, queued = self.store.on_device, deque()
                with kept.on_stream():
                    for g, coef in (item for batch in batches if batch is not None for item in batch):
                        kept.wait_for(g.landed)  # the gradient is computed (on the compute stream): not waited here
                        self.optimizers[g.unit].step(g.grad, g.lr, coef, self._scratch_of, False, g.skip)
                        queued.append((g.unit, kept.done()))
                        while queued and (queued[0][1] is None or queued[0][1].query()):
                            self._advance(queued.popleft()[0])
                for unit, done in queued:
                    done.synchronize()  # the new version is the unit's weights once its kernels ran
                    self._advance(unit)
                self.device_seconds += time.perf_counter() - t0
                if None in batches:
                    return
        except BaseException as e:
            self._fail(e)

    def _scratch_of(self, numel: int) -> torch.Tensor:
        """fp32 room for `numel` elements (at most a chunk), allocated once on first use: only torch's AdamW, on a
        compute-dtype or read-only gradient, asks for it."""
        if self._scratch is None:
            self._scratch = torch.empty(min(CHUNK_NUMEL, max(self.buffers.numels.values())))
        return self._scratch[:numel]

    def _advance(self, unit: str) -> None:
        with self._cond:
            self.version[unit] += 1
            self._advances += 1
            version = self.version[unit]
            self._cond.notify_all()
        if self.on_advance is not None:
            self.on_advance(unit, version)
