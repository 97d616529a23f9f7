"""The GPU worker: one streaming engine per GPU, fed and drained through its node's shared-memory arena.

The engine is the ordinary single-device `StreamingEngine` with its seams filled: `ArenaWeights`
streams each unit straight from the arena (the owning shard's fp32 master, cast on the GPU as
the single engine's `stream_master` does), once the unit's version word says the previous step's
update is in; `LandingBuffers` are where its gradients land (the arena's slots and pool, or this worker's
ring there, mt_ray.cluster.landing); `ArenaGrads` copies each out from a thread of its own and tells the node's
coordinator shard where it landed. A preference
stage's reference (and GRPO's, at β > 0) streams from the arena too (`ArenaReference`). A GRPO
worker only trains: the completions come from the rollout actor beside it (training/grpo/remote.py).
The worker holds no weights, no gradients and no optimizer state of its own, and nothing it does
per step copies or puts anything model-sized. Every wait that is not the GPU's own work (a device->host copy,
the shard's acknowledgement) runs on a helper thread, never on the thread that launches GPU work.
"""

from __future__ import annotations

import functools
import logging
import socket
import time
from dataclasses import replace
from datetime import timedelta

import ray
import torch
import torch.distributed as dist

from mt_ray.cluster.arena import ArenaHandle, NodeArena
from mt_ray.cluster.errors import ClusterError
from mt_ray.cluster.landing import ArenaGrads, LandingBuffers
from mt_ray.cluster.node_memory import process_bytes
from mt_ray.cluster.run_spec import NodePlan, RolloutBeside, RunSpec
from mt_ray.engine.engine import StreamingEngine
from mt_ray.engine.pinning import register_pinned, unregister_pinned

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


class EngineWorker:
    """A Ray actor running the engine's forward/backward on its part of each global batch."""

    def __init__(self, run: RunSpec, node: NodePlan, arena: ArenaHandle, shard, rank: int, generation: int,
                 start_step: int, timeout_s: float, rollout_beside: RolloutBeside | None = None):
        """Worker `rank` of the run `run`, on `node`: weights and gradients go through the node's arena (`arena`,
        which carries the layout the driver planned) and its coordinator shard `shard`. The stage's reference, where
        it streams one, is the arena's. `rollout_beside`: GRPO's plan of what shares this GPU, for a worker started
        after the plan (a lost one's replacement)."""
        spec = run.discover()
        cfg = run.engine
        self.rank = rank
        self.arena = NodeArena.attach(arena)
        # Page-locked once (a mapping registers 13x faster than pinned memory allocates): every upload and
        # every gradient's landing is then an asynchronous DMA.
        self.pinned = register_pinned(self.arena.bytes) if cfg.resolve_device().type == "cuda" else None
        self.weights = ArenaWeights(self.arena, generation, timeout_s)
        local_rank = node.local_rank(rank)
        self.landing = LandingBuffers(self.arena, local_rank, {u.name: u.numel for u in spec.trainable_units},
                                      timeout_s)
        self.grads = ArenaGrads(shard, rank, local_rank, generation, self.weights, self.landing,
                                [u.name for u in spec.units], timeout_s, cfg.resolve_device())
        reference = ArenaReference(self.arena) if arena.layout.ref_offsets else None
        self.engine = StreamingEngine(spec, cfg, run.optimizer, run.total_steps, grad_sink=self.grads,
                                      weight_source=self.weights, grad_buffers=self.landing, stage=run.stage,
                                      pref=run.pref, grpo=run.grpo, reference=reference)
        self.engine.step_idx = start_step  # weight versions and the LR schedule follow the shards
        if rollout_beside is not None:
            self.plan_rollout(rollout_beside)

    def plan_rollout(self, beside: RolloutBeside) -> str:
        """Before step 1: plan this worker's GPU with a GRPO rollout replica beside it (`RolloutBeside`), its kept
        block graphs for its share of the update's micro-batches, refused where the replica or `keep_activations`
        cannot fit. Returns the replica's placement (auto resolved)."""
        kept = self.engine.kept
        stage = replace(kept.stage, rollout_tokens=beside.tokens if beside.rows else 0, rollout_rows=beside.rows,
                        rollout_apart=True, rollout_placement=beside.placement)
        return kept.plan(self.engine.cfg, beside.micro_batch, beside.tokens, beside.n_micro, stage).rollout_placement

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
        self.weights.generation = generation
        self.grads.rejoin(generation)
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
    """Sum `grad` (the gradient dtype) into the node's local rank 0; the sum where this worker ships it.

    Asynchronous: NCCL runs the collective on a stream of its own once the compute stream has reached it, and only
    rank 0's compute stream waits for the sum (no host wait); the others go on at once, NCCL holding their copy.
    """
    work = dist.reduce(grad, dst=0, async_op=True)
    if local_rank != 0:
        return None
    work.wait()  # NCCL: the current stream waits for the collective; gloo (CPU): the sum is in
    return grad
