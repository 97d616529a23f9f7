"""The GPU worker: one streaming engine per GPU, fed and drained through its node's shared-memory arena.

The engine is the ordinary single-device `StreamingEngine` with its seams filled: `ArenaWeights`
streams each unit straight from the arena (the owning shard's fp32 master, cast on the GPU as
the single engine's `stream_master` does), once the unit's version word says the previous step's
update is in; `LandingBuffers` are where its gradients land (the arena's slots, or this worker's
ring there); `ArenaGrads` tells the node's coordinator shard where each landed. A preference
stage's reference (and GRPO's, at β > 0) streams from the arena too (`ArenaReference`). A GRPO
worker only trains: the completions come from the rollout actor beside it (training/grpo/remote.py).
The worker holds no weights, no gradients and no optimizer state of its own, and nothing it does
per step copies or puts anything model-sized. Every wait that is not the GPU's own work (a device->host copy,
the shard's acknowledgement) runs on a helper thread, never on the thread that launches GPU work.
"""

from __future__ import annotations

import functools
import logging
import queue
import socket
import threading
import time
from collections import deque
from datetime import timedelta

import ray
import torch
import torch.distributed as dist
from ray.exceptions import GetTimeoutError, RayActorError

from mt_ray.cluster.arena import SLOT, ArenaHandle, ArenaLayout, NodeArena
from mt_ray.cluster.errors import ClusterError
from mt_ray.cluster.node_memory import process_bytes
from mt_ray.cluster.partition import ShardPlan
from mt_ray.engine.config import EngineConfig, OptimizerConfig
from mt_ray.engine.engine import StreamingEngine
from mt_ray.engine.grpo import GrpoConfig
from mt_ray.engine.pinning import register_pinned, unregister_pinned
from mt_ray.engine.preference import PreferenceConfig
from mt_ray.engine.sizing import Stage
from mt_ray.errors import ModelNotSupportedError
from mt_ray.models.discovery import discover

log = logging.getLogger(__name__)


class ArenaWeights:
    """WeightSource: each unit's weights are the arena's, once its version word reaches the step."""

    def __init__(self, arena: NodeArena, generation: int, timeout_s: float):
        self.arena = arena
        self.generation = generation
        self.timeout_s = timeout_s
        self.wait_seconds = 0.0

    def wait_updated(self, unit: str, version: int) -> None:
        t0 = time.perf_counter()
        self.arena.wait_version(unit, version, self.generation, self.timeout_s)
        self.wait_seconds += time.perf_counter() - t0  # the engine's thread idle, waiting for weights

    def is_updated(self, unit: str, version: int) -> bool:
        return self.arena.version(unit) >= version

    def streamed_of(self, unit: str) -> torch.Tensor:
        return self.arena.weights(unit)

    def release(self, unit: str, copied: torch.cuda.Event | None) -> None:
        """Nothing to drop: the arena outlives the step (the shard updates a unit only after every upload of it)."""


class ArenaReference:
    """ReferenceSource: a preference stage's frozen reference, held once in the node's arena for all its workers."""

    def __init__(self, arena: NodeArena):
        self.arena = arena

    def streamed_of(self, unit: str) -> torch.Tensor:
        return self.arena.reference(unit)

    def close(self) -> None:
        """Nothing to free: the arena belongs to the node's shard."""


class LandingBuffers:
    """The engine's `GradBuffers` surface over the arena: where each gradient's device->host copy lands.

    The node's first worker lands every gradient whole in the unit's slot, where the shard adds the
    others' to it (a lone worker's is used as it is). Each further worker lands in a ring of its
    own, in pieces of at most half the ring (`ArenaLayout.pieces`), handed out first in, first out,
    and freed as the shard acknowledges each piece's sum; a full ring holds the engine's thread
    until then.
    """

    def __init__(self, arena: NodeArena, local_rank: int, numels: dict[str, int], ring: bool, timeout_s: float):
        self.arena = arena
        self.numels = numels
        self.ring = arena.ring(local_rank) if ring else None
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._live: deque[list] = deque()  # [(unit, piece start), ring lo, ring hi, freed], oldest first
        self._landed: dict[str, deque[tuple[int, int]]] = {}  # unit -> (piece start, where), not yet handed on

    def pieces(self, unit: str) -> list[tuple[int, int]]:
        n = self.numels[unit]
        return [(0, n)] if self.ring is None else self.arena.layout.pieces(n)

    def acquire(self, unit: str, lo: int, hi: int) -> torch.Tensor:
        if self.ring is None:
            self._landed.setdefault(unit, deque()).append((lo, SLOT))
            return self.arena.grad(unit)
        n = hi - lo
        with self._cond:
            if not self._cond.wait_for(lambda: self._fit(n) is not None, timeout=self.timeout_s):
                raise ClusterError(f"no room for {unit}'s gradient within cluster.step_timeout_s={self.timeout_s:g} s: "
                                   "the coordinator shard has not summed this worker's last gradients")
            at = self._fit(n)
            self._live.append([(unit, lo), at, at + n, False])
        self._landed.setdefault(unit, deque()).append((lo, at))
        return self.ring[at : at + n]

    def next_landed(self, unit: str) -> tuple[int | None, int]:
        """The oldest piece of `unit` acquired and not yet handed on: (its start in the unit, None for the slot's
        whole gradient; where it landed, as the shard's `put_grad` takes it)."""
        lo, where = self._landed[unit].popleft()
        return (None if where == SLOT else lo), where

    def release(self, unit: str, lo: int | None) -> None:
        """The shard has summed the piece of `unit` starting at `lo`: its part of the ring may be reused."""
        if self.ring is None:
            return
        with self._cond:
            for entry in self._live:
                if entry[0] == (unit, lo) and not entry[3]:
                    entry[3] = True
                    break
            while self._live and self._live[0][3]:
                self._live.popleft()
            self._cond.notify_all()

    def reset(self) -> None:
        """A new generation: nothing of the last one is waiting to be summed."""
        with self._cond:
            self._live.clear()
            self._landed.clear()
            self._cond.notify_all()

    def close(self) -> None:
        """Nothing to free: the arena belongs to the node's shard."""

    def _fit(self, n: int) -> int | None:
        """Where `n` contiguous elements are free after the newest live gradient, wrapping once; None if nowhere."""
        size = self.ring.numel()
        if not self._live:
            return 0 if n <= size else None
        tail, head = self._live[0][1], self._live[-1][2]
        if head > tail:  # live gradients lie in [tail, head): free after head, and before tail
            return head if size - head >= n else (0 if tail >= n else None)
        return head if tail - head >= n else None  # wrapped: free between head and tail


class ArenaGrads:
    """GradSink: tells the node's shard where each gradient landed, once its device->host copy is done.

    The ship thread waits for each copy's event and sends the shard a few bytes (`put_grad`); the
    ack thread waits, bounded, for each sum and frees that part of the ring.
    """

    def __init__(self, shard, rank: int, generation: int, weights: ArenaWeights, landing: LandingBuffers,
                 unit_order: list[str], timeout_s: float):
        self.shard = shard
        self.rank = rank
        self.generation = generation
        self.weights = weights
        self.landing = landing
        self.unit_order = unit_order
        self.timeout_s = timeout_s
        self.step = 0
        self._norm: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self._ship: queue.Queue = queue.Queue()
        self._acks: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        threading.Thread(target=self._ship_loop, name="mt-ray-grad-ship", daemon=True).start()
        threading.Thread(target=self._ack_loop, name="mt-ray-grad-ack", daemon=True).start()

    def submit(self, unit: str, grad: torch.Tensor | None, landed: torch.cuda.Event | None, lr: float,
               skip: tuple[tuple[int, int], ...] = ()) -> None:
        """`grad` None: this worker's rows did not use the unit (a vision unit, no image); the shard is told so.
        `skip` (tensors of the unit without a gradient) is not carried to the shards: it is refused."""
        self._raise_if_failed()
        if skip:
            raise ModelNotSupportedError(
                f"unit {unit} has tensors that got no gradient (a vision tower's tensors get_image_features never "
                "reads); a data-parallel run does not yet leave them untouched as torch's AdamW does, it would decay "
                "them; keep model.freeze_vision_tower: true, or train on one GPU")
        piece, where = self.landing.next_landed(unit) if grad is not None else (None, None)
        self._ship.put((self.step, unit, piece, where, landed))

    def end_step(self, norm_sq: torch.Tensor, ready: torch.cuda.Event | None, lr: float) -> None:
        """Kept: with one worker in the run its GPU's norm is the global one (the shards' clip uses it)."""
        self._norm = (norm_sq, ready)

    def norm_sq(self) -> float:
        norm_sq, ready = self._norm
        if ready is not None:
            ready.synchronize()  # the norm's device->host copy has landed
        return float(norm_sq)

    def wait_updated(self, unit: str, version: int) -> None:
        self.weights.wait_updated(unit, version)

    def flush(self) -> None:
        """Return once the shard has summed every gradient submitted so far."""
        self._ship.join()
        self._acks.join()
        self._raise_if_failed()

    def close(self) -> None:
        self._ship.put(None)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, (RayActorError, ClusterError)):
                raise error  # as it came: a lost shard stays a RayActorError for the driver
            raise ClusterError("handing a gradient to the coordinator shard failed") from error

    def _ship_loop(self) -> None:
        while (item := self._ship.get()) is not None:
            try:
                step, unit, piece, where, landed = item
                if landed is not None:
                    landed.synchronize()  # the device->host copy of this gradient (piece) has finished
                call = self.shard.put_grad.remote(self.generation, step, self.rank, unit, where, piece)
                self._acks.put((unit, piece, where is not None, call))
            except BaseException as e:  # surfaced to the engine thread by submit/flush
                self._error = e
            finally:
                self._ship.task_done()

    def _ack_loop(self) -> None:
        while True:
            unit, piece, used, ref = self._acks.get()
            try:
                ray.get(ref, timeout=self.timeout_s)  # the shard has summed it
                if used:
                    self.landing.release(unit, piece)
            except GetTimeoutError:
                self._error = ClusterError(f"the coordinator shard did not sum {unit}'s gradient of worker {self.rank} "
                                           f"within cluster.step_timeout_s={self.timeout_s:g} s")
            except BaseException as e:
                self._error = e
            finally:
                self._acks.task_done()


class EngineWorker:
    """A Ray actor running the engine's forward/backward on its part of each global batch."""

    def __init__(self, rank: int, model, engine_cfg: dict, opt_cfg: dict, total_steps: int, shard, local_shard: int,
                 num_shards: int, num_local: int, ring: int, arena: ArenaHandle, generation: int, start_step: int,
                 timeout_s: float, freeze: dict[str, bool] | None = None, stage: str = "sft",
                 pref: dict | None = None, grpo: dict | None = None):
        """Weights and gradients go through `arena`, the node of `local_shard` (`shard`, one of `num_shards`,
        with `num_local` workers landing gradients in it, rings of `ring` elements). `freeze`: the `discover`
        options the driver's spec was found with. `stage`, `pref` and `grpo`: the run's preference or GRPO stage
        (its reference, where it streams one, is the arena's)."""
        spec = discover(model, **(freeze or {}))
        cfg = EngineConfig(**engine_cfg)
        pref_cfg = PreferenceConfig(**(pref or {}))
        grpo_cfg = GrpoConfig(**(grpo or {}))
        reference = Stage.of(stage, pref_cfg, grpo_cfg).reference
        layout = ArenaLayout.build(spec, ShardPlan.build(spec, num_shards), local_shard, cfg.dtype,
                                   cfg.grad_torch_dtype, num_local, ring, reference)
        self.rank = rank
        self.arena = NodeArena.attach(layout, arena)
        # Page-locked once (a mapping registers 13x faster than pinned memory allocates): every upload and
        # every gradient's landing is then an asynchronous DMA.
        self.pinned = register_pinned(self.arena.bytes) if cfg.resolve_device().type == "cuda" else None
        self.weights = ArenaWeights(self.arena, generation, timeout_s)
        local_rank = rank % num_local
        self.landing = LandingBuffers(self.arena, local_rank, {u.name: u.numel for u in spec.trainable_units},
                                      local_rank > 0, timeout_s)
        self.grads = ArenaGrads(shard, rank, generation, self.weights, self.landing,
                                [u.name for u in spec.units], timeout_s)
        self.engine = StreamingEngine(spec, cfg, OptimizerConfig(**opt_cfg), total_steps, grad_sink=self.grads,
                                      weight_source=self.weights, grad_buffers=self.landing, stage=stage,
                                      pref=pref_cfg, grpo=grpo_cfg,
                                      reference=ArenaReference(self.arena) if reference else None)
        self.engine.step_idx = start_step  # weight versions and the LR schedule follow the shards

    def train_step(self, step: int, micro_batches: list[dict[str, torch.Tensor]], loss_normaliser: int,
                   timeout_s: float, pref_counts: dict[str, int] | None = None) -> dict:
        """This worker's part of global step `step`; its loss is its share of the global mean (a preference
        stage's: normalised by the global batch's `pref_counts`, its metric sums returned for the driver to add).
        Every wait in it (for weights, for room in the ring, for a sum) ends with an error after `timeout_s`.

        Returns once every gradient of the step is summed by this node's shard, so a worker lost
        after answering has lost nothing the step needs.
        """
        if step != self.engine.step_idx:
            raise ClusterError(f"worker {self.rank} is at step {self.engine.step_idx}, asked for step {step}")
        self._bound_waits(timeout_s)
        self.grads.step = step
        result = self.engine.train_step(micro_batches, loss_normaliser=loss_normaliser, pref_counts=pref_counts)
        loss = float(result.loss)  # waits for this worker's backward on the device
        self.grads.flush()
        # The router loss's share, weighted by this worker's loss tokens over the global count like the loss.
        aux = None if result.aux_loss is None else float(result.aux_loss)
        return {"loss": loss, "num_tokens": result.num_tokens, "aux_loss": aux, "norm_sq": self.grads.norm_sq(),
                "pref_sums": self._pref_sums(), "kept_logps": self._kept_logps()}

    def evaluate(self, micro_batches: list[dict[str, torch.Tensor]], timeout_s: float) -> dict:
        """Summed loss of this worker's part of an evaluation batch under the current weights (forward only),
        and a preference stage's metric sums."""
        self._bound_waits(timeout_s)
        result = self.engine.evaluate(micro_batches)
        return {"loss_sum": float(result.loss_sum), "num_loss_tokens": result.num_loss_tokens,
                "num_tokens": result.num_tokens, "pref_sums": self._pref_sums()}

    def sequence_logps(self, micro_batches: list[dict[str, torch.Tensor]], timeout_s: float) -> list[torch.Tensor]:
        """Each of this worker's micro-batches' sequence log-prob sums under the current weights (forward only)."""
        self._bound_waits(timeout_s)
        return [s.cpu() for s in self.engine.sequence_logps(micro_batches)]

    def _pref_sums(self) -> dict[str, float] | None:
        """The last step's (or evaluation's) preference metric sums over this worker's pairs or examples."""
        return None if self.engine.pref is None else {k: float(v) for k, v in self.engine.pref.sums.items()}

    def _kept_logps(self) -> list[torch.Tensor]:
        """GRPO's token log-probs of the step's micro-batches, where it keeps them (a rollout's first step, above
        one iteration): a few bytes per loss token, for the driver to hand back as the old policy's."""
        return [] if self.engine.pref is None else [t.cpu() for t in self.engine.kept_logps()]

    def _bound_waits(self, timeout_s: float) -> None:
        self.weights.timeout_s = self.landing.timeout_s = self.grads.timeout_s = timeout_s

    def rendezvous(self) -> tuple[str, int]:
        """An address and free port of this worker's node for its node's process group (`grad_reduce: nccl`)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def join_group(self, address: str, port: int, local_rank: int, size: int, timeout_s: float) -> None:
        """Join the node's process group, as Ray Train's TorchTrainer sets one up (NCCL between GPUs, gloo on
        CPUs): from now on each finished unit gradient is summed into local rank 0's, which alone ships it."""
        backend = "nccl" if self.engine.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=local_rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
        self.engine.reduce_grad = functools.partial(_reduce_to_first, local_rank)

    def weight_wait_seconds(self) -> float:
        """Cumulative time the engine's thread waited for weights (the benchmark's time split)."""
        return self.weights.wait_seconds

    def rejoin(self, generation: int, step: int) -> None:
        """Serve a new generation after another worker was lost or a checkpoint was restored."""
        self.weights.generation = self.grads.generation = generation
        self.landing.reset()
        self.engine.step_idx = step

    def host_bytes(self) -> dict[str, int]:
        """This process's memory now (`process_bytes`: its share of the arena, and its own)."""
        return process_bytes()

    def device(self) -> str:
        return str(self.engine.device)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.engine.close()
        if self.pinned is not None:
            unregister_pinned(self.pinned)


def _reduce_to_first(local_rank: int, unit: str, grad: torch.Tensor) -> torch.Tensor | None:
    """Sum `grad` into the node's local rank 0 (fp32, on the device); the sum where this worker ships it."""
    dist.reduce(grad, dst=0)
    return grad if local_rank == 0 else None
