"""The GPU worker: one streaming engine per GPU, fed and drained through the object store.

The engine is the ordinary single-device `StreamingEngine` with its two seams filled:
`ObjectStoreWeights` reads each unit's weights from the coordinator's published objects
(zero-copy views of node-local shared memory), and `ObjectStoreGrads` ships each finished
unit gradient back as an object. The worker holds no master weights and no optimizer state.
"""

from __future__ import annotations

import logging
import queue
import threading

import ray
import torch

from mt_ray.cluster.errors import ClusterError
from mt_ray.cluster.wire import from_numpy, to_numpy
from mt_ray.engine.config import EngineConfig, OptimizerConfig
from mt_ray.engine.engine import StreamingEngine
from mt_ray.engine.transfer import GradBuffers
from mt_ray.models.discovery import discover

log = logging.getLogger(__name__)

_CUDA_HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: the mapping may be read-only


class HostPins:
    """Page-locks object-store memory so uploads from it run as async DMA (CUDA only).

    Registration costs time proportional to the size, once per published object; the benchmark
    (bench/multi_gpu.py) weighs it against pageable uploads. If the driver refuses (e.g. two
    objects sharing a page), that unit simply uploads from pageable memory.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._held: dict[str, torch.Tensor] = {}

    def swap(self, unit: str, t: torch.Tensor) -> None:
        """Pin `t` as `unit`'s weights and unpin the version it replaces (long since uploaded)."""
        if not self.enabled:
            return
        self.release(unit)
        cudart = torch.cuda.cudart()
        nbytes = t.numel() * t.element_size()
        for flags in (0, _CUDA_HOST_REGISTER_READ_ONLY):
            if int(cudart.cudaHostRegister(t.data_ptr(), nbytes, flags)) == 0:
                self._held[unit] = t
                return

    def release(self, unit: str) -> None:
        t = self._held.pop(unit, None)
        if t is not None:
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())

    def close(self) -> None:
        for unit in list(self._held):
            self.release(unit)


class ObjectStoreWeights:
    """WeightSource: a unit's weights are a read-only view of the object the coordinator published."""

    def __init__(self, coordinator, generation: int, dtype: torch.dtype, pins: HostPins):
        self.coordinator = coordinator
        self.generation = generation
        self.dtype = dtype
        self.pins = pins
        self._held: dict[str, tuple[int, torch.Tensor]] = {}

    def wait_updated(self, unit: str, version: int) -> None:
        held = self._held.get(unit)
        if held is not None and held[0] == version:
            return  # a unit read twice in a step (tied embedding) is fetched once
        # Blocks until the coordinator has applied the previous step to this unit.
        [ref] = ray.get(self.coordinator.get_weights.remote(self.generation, unit, version))
        weights = from_numpy(ray.get(ref), self.dtype)  # maps the shared-memory object, no copy
        self.pins.swap(unit, weights)
        # Holding the view keeps the object alive; replacing it lets the store free the old version.
        self._held[unit] = (version, weights)

    def forget(self) -> None:
        """Drop every held version (a restored snapshot reuses version numbers)."""
        self._held.clear()

    def streamed_of(self, unit: str) -> torch.Tensor:
        return self._held[unit][1]


class ObjectStoreGrads:
    """GradSink: each finished gradient goes into the object store and on to its receiver.

    The receiver is the coordinator, or on a multi-node run this node's reducer (same `put_grad`).

    A thread does the shipping so the engine's thread never waits for a device->host copy:
    it waits for the copy's event, copies the host buffer into shared memory once, returns the
    buffer to the engine's pool and tells the receiver where the object is.
    """

    def __init__(self, receiver, rank: int, generation: int, weights: ObjectStoreWeights, unit_order: list[str]):
        self.receiver = receiver
        self.rank = rank
        self.generation = generation
        self.weights = weights
        self.unit_order = unit_order
        self.step = 0
        self.buffers: GradBuffers | None = None
        self._queue: queue.Queue = queue.Queue()
        self._sent: list[ray.ObjectRef] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mt-ray-grad-ship", daemon=True)
        self._thread.start()

    def bind(self, buffers: GradBuffers) -> None:
        """The engine's gradient buffers, released here once a gradient has been shipped."""
        self.buffers = buffers

    def submit(self, unit: str, grad: torch.Tensor, landed: torch.cuda.Event | None, lr: float) -> None:
        self._raise_if_failed()
        self._queue.put((self.step, unit, grad, landed))

    def end_step(self, norm_sq: torch.Tensor, ready: torch.cuda.Event | None, lr: float) -> None:
        """Nothing to do: the coordinator clips with the norm of the summed gradient, not this one."""

    def wait_updated(self, unit: str, version: int) -> None:
        self.weights.wait_updated(unit, version)

    def flush(self) -> float | None:
        """Return once the coordinator has received every gradient submitted so far.

        Returns the step's global gradient norm if one of this worker's gradients completed the step.
        """
        self._queue.join()
        self._raise_if_failed()
        norms = [n for n in ray.get(self._sent) if n is not None]
        self._sent.clear()
        return norms[0] if norms else None

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise ClusterError("shipping a gradient to the coordinator failed") from self._error

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                step, unit, grad, landed = item
                if landed is not None:
                    landed.synchronize()  # the device->host copy of this gradient has finished
                ref = ray.put(to_numpy(grad))  # the one host copy: into shared memory
                self.buffers.release(unit)
                self._sent.append(self.receiver.put_grad.remote(self.generation, step, self.rank, unit, ref))
            except BaseException as e:  # surfaced to the engine thread by submit/flush
                self._error = e
            finally:
                self._queue.task_done()
        self._queue.task_done()


class EngineWorker:
    """A Ray actor running the engine's forward/backward on its shard of each global batch."""

    def __init__(self, rank: int, model, engine_cfg: dict, opt_cfg: dict, total_steps: int, coordinator,
                 generation: int, start_step: int, reducer=None):
        """Weights come from `coordinator`; gradients go to this node's `reducer` if any, else to it too."""
        spec = discover(model)
        cfg = EngineConfig(**engine_cfg)
        # The coordinator clips the summed gradient; this engine never clips, so its gradients
        # recycle through a few slabs instead of holding a whole model's worth until step end.
        opt = OptimizerConfig(**{**opt_cfg, "max_grad_norm": 0.0})
        self.rank = rank
        self.pins = HostPins(cfg.resolve_device().type == "cuda")
        self.weights = ObjectStoreWeights(coordinator, generation, cfg.dtype, self.pins)
        self.grads = ObjectStoreGrads(reducer or coordinator, rank, generation, self.weights,
                                      [u.name for u in spec.units])
        self.engine = StreamingEngine(spec, cfg, opt, total_steps, grad_sink=self.grads, weight_source=self.weights)
        self.grads.bind(self.engine.grad_buffers)
        self.engine.step_idx = start_step  # weight versions and the LR schedule follow the coordinator

    def train_step(self, step: int, micro_batches: list[dict[str, torch.Tensor]], loss_normaliser: int) -> dict:
        """This worker's part of global step `step`; its loss is its share of the global mean."""
        if step != self.engine.step_idx:
            raise ClusterError(f"worker {self.rank} is at step {self.engine.step_idx}, asked for step {step}")
        self.grads.step = step
        result = self.engine.train_step(micro_batches, loss_normaliser=loss_normaliser)
        grad_norm = self.grads.flush()  # every gradient of the step is with the coordinator before we answer
        return {"loss": float(result.loss), "num_tokens": result.num_tokens, "grad_norm": grad_norm}

    def rejoin(self, generation: int, step: int) -> None:
        """Serve a new generation after another worker was lost: forget the old generation's weights."""
        self.pins.close()
        self.weights.generation = self.grads.generation = generation
        self.weights.forget()
        self.engine.step_idx = step

    def device(self) -> str:
        return str(self.engine.device)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def close(self) -> None:
        self.engine.close()
        self.pins.close()
