"""The cluster's public interface for GRPO's rollout replicas (mt_ray.training.grpo.remote): where each replica sits,
what its worker plans beside it, and the weights it reads from its node's arena.

The trainer hands out a `RolloutHost` (`DataParallelTrainer.rollout_host`, mt_ray.cluster.actors): the seats
(`ReplicaSeat`), the workers' plans beside the replicas (`run_spec.RolloutBeside`), the weights' version to read
(`WeightsVersion`); a replica reads the weights through `WeightsReader`, never through the arena's layout or words.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mt_ray.cluster.arena import ArenaHandle, NodeArena
from mt_ray.cluster.run_spec import RunSpec
from mt_ray.engine.pinning import register_pinned
from mt_ray.models.discovery import UnitSpec


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
