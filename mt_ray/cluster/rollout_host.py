"""The cluster's public interface for GRPO's rollout replicas (mt_ray.training.grpo.remote): where each replica sits,
what its worker plans beside it, and the weights it reads from its node's arena.

The trainer hands out a `RolloutHost` (`DataParallelTrainer.rollout_host`): the seats, the workers' plans beside
the replicas, the weights' version to read; a replica reads the weights through `WeightsReader`, never through the
arena's layout or words.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
import torch

from mt_ray.cluster.arena import ArenaHandle, NodeArena
from mt_ray.cluster.placement import RolloutPlace, worker_devices
from mt_ray.cluster.run_spec import RunSpec
from mt_ray.engine.pinning import register_pinned
from mt_ray.models.discovery import UnitSpec

if TYPE_CHECKING:
    from mt_ray.cluster.actors import ClusterActors


@dataclass(frozen=True)
class RolloutBeside:
    """What shares each worker's GPU with its rollout replica: `rows` completions (0: none beside it) of up to
    `tokens` tokens, placed as `placement` (`rollout.placement`), beside steps of `n_micro` micro-batches of
    `micro_batch` rows."""

    rows: int
    tokens: int
    placement: str
    micro_batch: int
    n_micro: int


@dataclass(frozen=True)
class ReplicaSeat:
    """Where one rollout replica runs and what it reads."""

    worker: int  # the worker it runs beside (node 0's first, for a replica with GPUs of its own)
    name: str  # how errors name it
    options: dict[str, Any]  # Ray actor options that place it in its worker's node bundle
    run: RunSpec
    arena: ArenaHandle  # its node's arena
    threads: int  # CPU threads it may use (its worker's, idle while it generates)


@dataclass(frozen=True)
class WeightsVersion:
    """The weights a refresh reads: those after `step` steps of `generation`, each unit waited for at most
    `timeout_s` in all (`cluster.step_timeout_s`)."""

    step: int
    generation: int
    timeout_s: float


class WeightsReader:
    """A node's streamed weights, read by an actor beside its workers: the shard's fp32 master for its units, the
    compute dtype for other nodes' units, each once its version word says the update is in."""

    def __init__(self, run: RunSpec, arena: ArenaHandle):
        self.spec = run.discover()
        self._arena = NodeArena.attach(arena)

    def page_lock(self) -> None:
        """Page-lock the weights for this process's life: each read's uploads are then DMAs (the mapping and its
        registration go with the process)."""
        register_pinned(self._arena.weights_region())

    def updated_units(self, version: WeightsVersion) -> Iterator[tuple[UnitSpec, torch.Tensor]]:
        """Every unit with its flat weights, in model order, each as soon as its update to `version.step` is in;
        all within `version.timeout_s` (the error names the unit)."""
        deadline = time.monotonic() + version.timeout_s
        for unit in self.spec.units:
            self._arena.wait_version(unit.name, version.step, version.generation,
                                     max(0.0, deadline - time.monotonic()))
            yield unit, self._arena.weights(unit.name)


class RolloutHost:
    """What GRPO's rollout replicas get from the cluster: their seats, their workers' plans beside them, and the
    weights' version to read. Calls to actors are returned to wait for (`remote.wait_replies` names the late)."""

    def __init__(self, actors: ClusterActors, place: RolloutPlace, version: Callable[[], WeightsVersion],
                 timeout_s: float):
        self._actors = actors
        self._place = place
        self._version = version
        self.num_workers = actors.want.num_workers
        self.timeout_s = timeout_s  # `cluster.step_timeout_s`: every wait for a replica is bounded by it

    @property
    def shares_gpu(self) -> bool:
        """Whether each replica runs on its worker's GPU (else on CPUs, or on GPUs of its own)."""
        return self._place.shared and bool(self._actors.want.gpus_per_worker)

    def seats(self) -> list[ReplicaSeat]:
        """Where each replica runs (beside each worker, or one with GPUs of its own on node 0), and its arena."""
        actors, shared = self._actors, self._place.shared
        return [ReplicaSeat(w, f"the rollout replica beside worker {w}" if shared else "the rollout replica",
                            actors.rollout_options(w), actors.run, actors.arenas[actors.node_of(w)],
                            int(actors.cluster.cpus_per_worker))
                for w in self._place.beside(self.num_workers)]

    def worker_devices(self, ranks: list[int]) -> list[ray.ObjectRef]:
        """Each worker's CUDA devices (the GPU its replica shares)."""
        return [self._actors.workers[w].__ray_call__.remote(worker_devices) for w in ranks]

    def plan_beside(self, beside: RolloutBeside) -> list[ray.ObjectRef]:
        """Every worker plans its GPU with a replica beside it (each answers the replica's placement); workers
        started later plan the same."""
        self._actors.rollout_beside = beside
        return [w.plan_rollout.remote(beside) for w in self._actors.workers]

    def version(self) -> WeightsVersion:
        """The weights after every step so far, as a replica reads them."""
        return self._version()
