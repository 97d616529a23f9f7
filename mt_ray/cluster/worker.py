"""The GPU worker: one streaming engine per GPU, fed and drained through the node's object store.

The engine is the ordinary single-device `StreamingEngine` with its two seams filled:
`ObjectStoreWeights` reads each unit's weights from the owning shard's published objects
(zero-copy views of node-local shared memory), and `ObjectStoreGrads` hands each finished unit
gradient to this node's coordinator shard. The worker holds no master weights and no optimizer
state. Every wait that is not the GPU's own work (a fetch, page-locking, a release) runs on a
helper thread, never on the thread that launches GPU work.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import ray
import torch

from mt_ray.cluster.errors import ClusterError, StaleGenerationError
from mt_ray.cluster.partition import ShardPlan
from mt_ray.cluster.wire import from_numpy, to_numpy
from mt_ray.engine.config import EngineConfig, OptimizerConfig
from mt_ray.engine.engine import StreamingEngine
from mt_ray.engine.transfer import GradBuffers
from mt_ray.models.discovery import discover
from mt_ray.models.vision import is_vision_unit

log = logging.getLogger(__name__)

_CUDA_HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: the mapping may be read-only
GRADS_IN_FLIGHT = 2  # gradients per worker in the object store, not yet summed by the shard
WORKER_GRAD_SLABS = 2  # the engine's pinned gradient slabs in a worker


def find_mapping(address: int) -> tuple[int, int, str] | None:
    """The [start, end) and file of this process's memory mapping holding `address` (Linux)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo <= address < hi:
                    return lo, hi, fields[5] if len(fields) > 5 else ""
    except OSError:
        pass
    return None


class StorePins:
    """Page-locks the object store's shared memory, once per mapping, so uploads are async DMA (CUDA).

    Ray maps a node's whole object store into a worker as one shared mapping. Registering that
    mapping once (about 0.06 s per GiB) makes every object later published into it uploadable at
    full speed, with no registration per object per step. An object outside any registered
    mapping (a store that spilled to a fallback file) is registered alone while it is held.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._mappings: list[tuple[int, int]] = []
        self._alone: dict[int, torch.Tensor] = {}  # data_ptr -> tensor registered by itself

    def ensure(self, t: torch.Tensor) -> None:
        if not self.enabled or t.numel() == 0:
            return
        ptr = t.data_ptr()
        if any(lo <= ptr < hi for lo, hi in self._mappings):
            return
        mapping = find_mapping(ptr)
        if mapping is not None and _register(mapping[0], mapping[1] - mapping[0]):
            self._mappings.append(mapping[:2])
            log.info("page-locked the object store mapping %s (%.1f GiB)", mapping[2], (mapping[1] - mapping[0]) / 2**30)
        elif _register(ptr, t.numel() * t.element_size()):
            self._alone[ptr] = t

    def forget(self, t: torch.Tensor) -> None:
        """`t` is no longer read: unregister it if it was registered by itself."""
        if self._alone.pop(t.data_ptr(), None) is not None:
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())

    def close(self) -> None:
        cudart = torch.cuda.cudart() if self.enabled else None
        for ptr in [*self._alone, *(lo for lo, _ in self._mappings)]:
            cudart.cudaHostUnregister(ptr)
        self._alone.clear()
        self._mappings.clear()


def _register(ptr: int, nbytes: int) -> bool:
    cudart = torch.cuda.cudart()
    return any(int(cudart.cudaHostRegister(ptr, nbytes, flags)) == 0 for flags in (0, _CUDA_HOST_REGISTER_READ_ONLY))


class ObjectStoreWeights:
    """WeightSource: each unit's weights are a read-only view of the object its owner shard published.

    `begin_step` hands a fetch thread the step's units in forward order; it waits for each
    version to be published, maps it and page-locks it, so the engine's `wait_updated` finds it
    ready. `release` (after a unit's last upload of the step has landed) drops the view, and with
    it this worker's hold on the object: the store frees a version once every worker is done.
    A frozen unit never changes: fetched once per generation, its view serves every step.
    """

    def __init__(self, shards: list, plan: ShardPlan, generation: int, dtype: torch.dtype, pins: StorePins,
                 frozen: set[str]):
        self.shards = shards
        self.plan = plan
        self.generation = generation
        self.dtype = dtype
        self.pins = pins
        self.frozen = frozen
        self._cond = threading.Condition()
        self._held: dict[str, tuple[int, ray.ObjectRef, torch.Tensor]] = {}
        self.wait_seconds = 0.0
        self._error: BaseException | None = None
        self._fetches: queue.Queue = queue.Queue()
        self._releases: queue.Queue = queue.Queue()
        threading.Thread(target=self._fetch_loop, name="mt-ray-fetch", daemon=True).start()
        threading.Thread(target=self._release_loop, name="mt-ray-release", daemon=True).start()

    def begin_step(self, version: int, units: list[str]) -> None:
        """Fetch `units` (the step's, in forward order) as published after `version` steps."""
        self._fetches.put((self.generation, version, units))

    def wait_updated(self, unit: str, version: int) -> None:
        t0 = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or self._holds(unit, version))
            self.wait_seconds += time.perf_counter() - t0  # the engine's thread idle, waiting for weights
            if self._error is not None:
                error, self._error = self._error, None
                raise error  # as it came (a lost shard stays a RayActorError for the driver)

    def streamed_of(self, unit: str) -> torch.Tensor:
        return self._held[unit][2]

    def release(self, unit: str, copied: torch.cuda.Event | None) -> None:
        if unit not in self.frozen:  # kept for the generation
            self._releases.put((unit, copied))

    def _holds(self, unit: str, version: int) -> bool:
        """Whether `unit`'s weights after `version` steps are mapped (lock held); any version of a frozen unit."""
        held = self._held.get(unit)
        return held is not None and (held[0] == version or unit in self.frozen)

    def forget(self, generation: int) -> None:
        """Serve `generation` from now on: drop every held version (a restored state reuses version numbers)."""
        self._releases.join()
        with self._cond:
            self.generation = generation
            held, self._held = self._held, {}
            self._error = None
        for _, _, t in held.values():
            self.pins.forget(t)

    def _fetch_loop(self) -> None:
        while True:
            generation, version, units = self._fetches.get()
            try:
                for unit in units:
                    if unit in self.frozen and unit in self._held:
                        continue  # a frozen unit's view of this generation, fetched once
                    owner = self.shards[self.plan.owner(unit)]
                    # Blocks until the owner has applied the previous step to this unit.
                    [ref] = ray.get(owner.get_weights.remote(generation, unit, version))
                    weights = from_numpy(ray.get(ref), self.dtype)  # maps the shared-memory object, no copy
                    self.pins.ensure(weights)
                    with self._cond:
                        if generation != self.generation:
                            break
                        self._held[unit] = (version, ref, weights)
                        self._cond.notify_all()
            except StaleGenerationError:
                continue  # a recovery is replacing this generation; `forget` follows
            except BaseException as e:  # surfaced on the engine's thread by wait_updated
                with self._cond:
                    self._error = e
                    self._cond.notify_all()

    def _release_loop(self) -> None:
        while True:
            unit, copied = self._releases.get()
            try:
                if copied is not None:
                    copied.synchronize()  # the upload has read the host copy
                with self._cond:
                    held = self._held.pop(unit, None)
                if held is not None:
                    self.pins.forget(held[2])
            finally:
                self._releases.task_done()


class ObjectStoreGrads:
    """GradSink: each finished gradient goes into the object store and on to this node's shard.

    A thread does the shipping so the engine's thread never waits for a device->host copy: it
    waits for the copy's event, copies the host buffer into shared memory once, returns the
    buffer to the engine's pool and hands the object to the shard. At most GRADS_IN_FLIGHT
    gradients wait in the object store for the shard to sum them.
    """

    def __init__(self, shard, rank: int, generation: int, weights: ObjectStoreWeights, unit_order: list[str]):
        self.shard = shard
        self.rank = rank
        self.generation = generation
        self.weights = weights
        self.unit_order = unit_order
        self.step = 0
        self.buffers: GradBuffers | None = None
        self._queue: queue.Queue = queue.Queue()
        self._sent: deque[ray.ObjectRef] = deque()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mt-ray-grad-ship", daemon=True)
        self._thread.start()

    def bind(self, buffers: GradBuffers) -> None:
        """The engine's gradient buffers, released here once a gradient has been shipped."""
        self.buffers = buffers

    def submit(self, unit: str, grad: torch.Tensor | None, landed: torch.cuda.Event | None, lr: float) -> None:
        """`grad` None: this worker's rows did not use the unit (a vision unit, no image); the shard is told so."""
        self._raise_if_failed()
        self._queue.put((self.step, unit, grad, landed))

    def end_step(self, norm_sq: torch.Tensor, ready: torch.cuda.Event | None, lr: float) -> None:
        """Nothing to do: the shards clip with the norm of the summed gradient, not this one."""

    def wait_updated(self, unit: str, version: int) -> None:
        self.weights.wait_updated(unit, version)

    def flush(self) -> None:
        """Return once the shard has summed every gradient submitted so far."""
        self._queue.join()
        self._raise_if_failed()
        ray.get(list(self._sent))
        self._sent.clear()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise ClusterError("shipping a gradient to the coordinator shard failed") from self._error

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                step, unit, grad, landed = item
                if len(self._sent) >= GRADS_IN_FLIGHT:
                    ray.get(self._sent.popleft())  # back-pressure: the shard is summing our last ones
                if landed is not None:
                    landed.synchronize()  # the device->host copy of this gradient has finished
                ref = None
                if grad is not None:
                    ref = ray.put(to_numpy(grad))  # the one host copy: into shared memory
                    self.buffers.release(unit)
                self._sent.append(self.shard.put_grad.remote(self.generation, step, self.rank, unit, [ref]))
            except BaseException as e:  # surfaced to the engine thread by submit/flush
                self._error = e
            finally:
                self._queue.task_done()
        self._queue.task_done()


class EngineWorker:
    """A Ray actor running the engine's forward/backward on its part of each global batch."""

    def __init__(self, rank: int, model, engine_cfg: dict, opt_cfg: dict, total_steps: int, shards: list,
                 local_shard: int, generation: int, start_step: int, freeze: dict[str, bool] | None = None):
        """Weights come from each unit's owner among `shards`; gradients go to `shards[local_shard]`.
        `freeze`: the `discover` options the driver's spec was found with (an image-text model's freeze flags)."""
        spec = discover(model, **(freeze or {}))
        # Its gradients leave each slab for the object store at once: two slabs let one download
        # land while the other ships (each is as large as the largest unit).
        cfg = EngineConfig(**{**engine_cfg, "grad_slabs": WORKER_GRAD_SLABS})
        # The shards clip the summed gradient; this engine never clips, so its gradients
        # recycle through a few slabs instead of holding a whole model's worth until step end.
        opt = OptimizerConfig(**{**opt_cfg, "max_grad_norm": 0.0})
        units = [u.name for u in spec.units]
        self.rank = rank
        self.all_units = units
        self.text_units = [u for u in units if not is_vision_unit(u)]  # what a step without images reads
        self.pins = StorePins(cfg.resolve_device().type == "cuda")
        self.weights = ObjectStoreWeights(shards, ShardPlan.build(spec, len(shards)), generation, cfg.dtype,
                                          self.pins, {u.name for u in spec.units if u.frozen})
        self.grads = ObjectStoreGrads(shards[local_shard], rank, generation, self.weights, units)
        self.engine = StreamingEngine(spec, cfg, opt, total_steps, grad_sink=self.grads, weight_source=self.weights)
        self.grads.bind(self.engine.grad_buffers)
        self.engine.step_idx = start_step  # weight versions and the LR schedule follow the shards

    def train_step(self, step: int, micro_batches: list[dict[str, torch.Tensor]], loss_normaliser: int) -> dict:
        """This worker's part of global step `step`; its loss is its share of the global mean.

        Returns once every gradient of the step is summed by this node's shard, so a worker lost
        after answering has lost nothing the step needs.
        """
        if step != self.engine.step_idx:
            raise ClusterError(f"worker {self.rank} is at step {self.engine.step_idx}, asked for step {step}")
        self.grads.step = step
        self.weights.begin_step(step, self._units_read(micro_batches))
        result = self.engine.train_step(micro_batches, loss_normaliser=loss_normaliser)
        loss = float(result.loss)  # waits for this worker's backward on the device
        self.grads.flush()
        # The router loss's share, weighted by this worker's loss tokens over the global count like the loss.
        aux = None if result.aux_loss is None else float(result.aux_loss)
        return {"loss": loss, "num_tokens": result.num_tokens, "aux_loss": aux}

    def evaluate(self, micro_batches: list[dict[str, torch.Tensor]]) -> dict:
        """Summed loss of this worker's part of an evaluation batch under the current weights (forward only)."""
        self.weights.begin_step(self.engine.step_idx, self._units_read(micro_batches))
        result = self.engine.evaluate(micro_batches)
        return {"loss_sum": float(result.loss_sum), "num_loss_tokens": result.num_loss_tokens,
                "num_tokens": result.num_tokens}

    def _units_read(self, micro_batches: list[dict]) -> list[str]:
        """The units the engine reads for these micro-batches: the vision ones only where a row has an image."""
        images = any(image for mb in micro_batches for row in mb.get("images") or () for image in row)
        return self.all_units if images else self.text_units

    def weight_wait_seconds(self) -> float:
        """Cumulative time the engine's thread waited for published weights (the benchmark's time split)."""
        return self.weights.wait_seconds

    def rejoin(self, generation: int, step: int) -> None:
        """Serve a new generation after another worker was lost or a checkpoint was restored."""
        self.weights.forget(generation)
        self.grads.generation = generation
        self.engine.step_idx = step

    def device(self) -> str:
        return str(self.engine.device)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def close(self) -> None:
        self.engine.close()
        self.pins.close()
