"""What a coordinator shard keeps between its calls: one generation's landings and sums, snapshots, and the
thread teams it sums and updates with (mt_ray.cluster.shard runs them)."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError

from mt_ray.cluster.errors import StaleGenerationError
from mt_ray.engine.optimizer_worker import OptimizerWorker

# Intra-op threads of the reduce thread, where gradients are summed beside the optimizer. Two OpenMP teams of
# every core but one oversubscribe the node: on 2 x H200 the sum fell from 1.2 to 0.36 Gelem/s beside Adam;
# with teams of 8 and 23 it held 1.05, Adam 3.7 Gparam/s against 4.5 (bench/gradient_sum.py).
SUM_THREADS = 8
GET_POLL_S = 1.0  # how often a read of another node's object checks that its generation still runs
PEER_WAIT_S = 600.0  # how long a message of a newer generation waits for this shard to start it, and a peer's answer


@dataclass
class Snapshot:
    """The flat state and each trained unit's Adam count after `step` steps: what a recovery restores."""

    step: int
    tensors: dict[str, torch.Tensor]
    adam_counts: dict[str, int]


@dataclass
class Landing:
    """One unit's gradients of one step on this node, piece by piece, as its workers report them."""

    got: dict[int, dict[int, int | None]]  # piece start -> local rank -> where it landed (SLOT, ring offset; None: unused)
    ends: dict[int, int]  # piece start -> end
    left: int  # pieces not yet summed
    used: bool = False  # some worker's rows used the unit
    piece_seqs: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # piece start -> (local rank, report)
    unit_seqs: list[tuple[int, int]] = field(default_factory=list)  # whole landings' and unused units' reports
    norm_sq: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))  # of the fp32 sums
    dest: torch.Tensor | None = None  # where the node's sum is made (`CoordinatorShard._node_sum`), from the first sum

    def ranks_in(self) -> list[int]:
        """Local workers whose every piece is in."""
        return sorted(set.intersection(*(set(g) for g in self.got.values())))


@dataclass
class Generation:
    """Everything one generation of workers may touch; a recovery or a restore starts a new one."""

    number: int
    step: int
    opt: OptimizerWorker | None = None
    local: dict[tuple[int, str], Landing] = field(default_factory=dict)
    local_norms: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # of a node's sum, several workers
    remote: dict[tuple[int, str], dict[int, list[torch.Tensor]]] = field(default_factory=dict)
    norms: dict[int, dict[str, torch.Tensor | None]] = field(default_factory=dict)  # None: the lone worker's GPU has it
    forwarded: dict[int, list[ray.ObjectRef]] = field(default_factory=dict)
    forward_inflight: dict[int, deque[ray.ObjectRef]] = field(default_factory=dict)  # owner -> partials not summed
    partials_summed: dict[tuple[int, str], threading.Event] = field(default_factory=dict)  # set once read by the sum
    acks: dict[tuple, list[tuple[int, int]]] = field(default_factory=dict)  # (step, unit[, piece]) -> reports it ends
    advanced: dict[int, int] = field(default_factory=dict)  # version -> trained units updated to it
    touched: set[int] = field(default_factory=set)
    ended: set[int] = field(default_factory=set)
    stopped: bool = False


def read_unless_stopped(gen: Generation, ref: ray.ObjectRef) -> np.ndarray:
    """`ray.get(ref)`, given up (StaleGenerationError) once `gen` is stopped.

    Another node's object is owned by that node's shard; should the owner die while the object
    is read, Ray may wait for it forever (ray-project/ray#63694), and `stop` waits for the
    reduce thread. Polling bounds that wait by the driver's decision to end the step.
    """
    while True:
        try:
            return ray.get(ref, timeout=GET_POLL_S)
        except GetTimeoutError:
            if gen.stopped:
                raise StaleGenerationError(f"generation {gen.number} was stopped while reading a gradient") from None


class GradSlots:
    """The `buffers` surface the optimizer releases gradients through: the arena's slots, reused every step."""

    def __init__(self, numels: dict[str, int]):
        self.numels = numels

    def release(self, unit: str) -> None:
        """Nothing to free: a slot is written again only after the unit's next upload, which waits for this update."""


def split_threads(cores: int, sums: bool) -> tuple[int, int]:
    """(optimizer, sum) intra-op threads of a shard given `cores` in all: disjoint teams where the shard `sums`
    gradients (several local workers or nodes) and has cores to split, else the optimizer's count for both."""
    if not sums or cores < 4:
        return cores, cores
    sum_threads = min(SUM_THREADS, cores // 4)
    return cores - sum_threads, sum_threads
