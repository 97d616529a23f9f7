"""What a coordinator shard's parts share, explicitly: which units it owns (`ShardUnits`), its running generation
and its health (`ShardStatus`, one lock for all its parts), and the thread teams it sums and updates with.

Each part keeps its own record of a generation (`SumRound` for the node's sum, `UpdateRound` for the updates),
reached through the `Generation` it was started with, so a late call of a stopped generation never touches the
next one's.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError

from mt_ray.cluster.arena import FAILED, NodeArena
from mt_ray.cluster.errors import ClusterError, StaleGenerationError
from mt_ray.cluster.partition import ShardPlan
from mt_ray.engine.optimizer_worker import OptimizerWorker
from mt_ray.models.discovery import ModelSpec

# Intra-op threads of the reduce thread, where gradients are summed beside the optimizer. Two OpenMP teams of
# every core but one oversubscribe the node: on 2 x H200 the sum fell from 1.2 to 0.36 Gelem/s beside Adam;
# with teams of 8 and 23 it held 1.05, Adam 3.7 Gparam/s against 4.5 (bench/gradient_sum.py).
SUM_THREADS = 8
GET_POLL_S = 1.0  # how often a read of another node's object checks that its generation still runs
PEER_WAIT_S = 600.0  # how long a message of a newer generation waits for this shard to start it, and a peer's answer


@dataclass(frozen=True)
class ShardUnits:
    """Which units a shard owns and how its node's gradients arrive: read-only, shared by all its parts."""

    spec: ModelSpec
    plan: ShardPlan
    shard: int
    num_local: int  # workers landing gradients on the node
    owned: tuple[str, ...]
    trained: tuple[str, ...]  # owned units gradients come for
    frozen: frozenset[str]  # every frozen unit of the model
    pieces: dict[str, dict[int, int]]  # trained unit -> piece start -> end, as the node's workers land them

    @classmethod
    def build(cls, spec: ModelSpec, plan: ShardPlan, shard: int, num_local: int,
              pieces: dict[str, list[tuple[int, int]]]) -> ShardUnits:
        owned = plan.units_of(shard)
        return cls(spec, plan, shard, num_local, tuple(u.name for u in owned),
                   tuple(u.name for u in owned if not u.frozen), frozenset(u.name for u in spec.units if u.frozen),
                   {u: dict(p) for u, p in pieces.items()})

    @property
    def num_shards(self) -> int:
        return self.plan.num_shards


# (step, unit) of a whole unit's sum, or (step, unit, piece start) of a ring piece's
Key = tuple


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
    dest: torch.Tensor | None = None  # where the node's sum is made (`node_sum.NodeSum._node_sum`), from the first sum

    def ranks_in(self) -> list[int]:
        """Local workers whose every piece is in."""
        return sorted(set.intersection(*(set(g) for g in self.got.values())))


@dataclass
class SumRound:
    """The node sum's record of one generation (mt_ray.cluster.node_sum): landings, other nodes' partials, and
    what this node has sent on."""

    local: dict[tuple[int, str], Landing] = field(default_factory=dict)
    local_norms: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # of a node's sum, several workers
    remote: dict[tuple[int, str], dict[int, list[torch.Tensor]]] = field(default_factory=dict)
    forwarded: dict[int, list[ray.ObjectRef]] = field(default_factory=dict)
    forward_inflight: dict[int, deque[ray.ObjectRef]] = field(default_factory=dict)  # owner -> partials not summed
    partials_summed: dict[tuple[int, str], threading.Event] = field(default_factory=dict)  # set once read by the sum
    acks: dict[Key, list[tuple[int, int]]] = field(default_factory=dict)  # key -> reports it ends


@dataclass
class UpdateRound:
    """The updates' record of one generation (mt_ray.cluster.updates): its optimizer thread and what each step
    has reached."""

    opt: OptimizerWorker | None = None
    norms: dict[int, dict[str, torch.Tensor | None]] = field(default_factory=dict)  # None: the lone worker's GPU has it
    advanced: dict[int, int] = field(default_factory=dict)  # version -> trained units updated to it
    touched: set[int] = field(default_factory=set)  # steps some unit was updated in (only without clipping)
    ended: set[int] = field(default_factory=set)  # steps whose global norm has come (`apply_norm`)


@dataclass
class Generation:
    """One generation of workers as the shard's parts see it; a recovery or a restore starts a new one."""

    number: int
    step: int
    sums: SumRound
    updates: UpdateRound
    stopped: bool = False


class ShardStatus:
    """The shard's running generation and its first failure, under the one lock (`cond`) its parts share."""

    def __init__(self, arena: NodeArena, shard: int):
        self.arena = arena
        self.shard = shard
        self.cond = threading.Condition()
        self.gen: Generation | None = None
        self.error: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        """A sum, an update or a publication failed: the driver's calls and the workers' waits end with an error."""
        with self.cond:
            self.error = self.error or error
            self.cond.notify_all()
        self.arena.set_state(FAILED)

    def note(self, error: BaseException, generation: int) -> None:
        """A peer of running `generation` failed to answer: the driver's next call here says so."""
        with self.cond:
            if not self.stale(generation):
                self.error = error
                self.cond.notify_all()

    def stale(self, generation: int) -> bool:
        return self.gen is None or generation != self.gen.number or self.gen.stopped

    def raise_if_stale(self, generation: int) -> None:
        if self.stale(generation):
            raise StaleGenerationError(f"generation {generation} was stopped")
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise ClusterError(f"coordinator shard {self.shard}'s sum or optimizer failed") from self.error

    def generation_of(self, generation: int) -> Generation | None:
        """The running generation if it is `generation` (waiting, bounded, for this shard to start it), else None
        (a stopped or replaced one)."""
        with self.cond:
            if not self.cond.wait_for(lambda: self.gen is not None and self.gen.number >= generation,
                                      timeout=PEER_WAIT_S):
                raise ClusterError(f"coordinator shard {self.shard} did not start generation {generation} within "
                                   f"{PEER_WAIT_S:g} s of a message of it")
            return None if self.stale(generation) else self.gen


def read_unless_stopped(gen: Generation, ref: ray.ObjectRef, what: str = "an object",
                        timeout_s: float = PEER_WAIT_S) -> np.ndarray:
    """`ray.get(ref)`, given up (StaleGenerationError) once `gen` is stopped, or (ClusterError naming `what`)
    after `timeout_s`.

    Another node's object is owned by that node's shard; should the owner die while the object
    is read, Ray may wait for it forever (ray-project/ray#63694), and `stop` waits for the
    reduce thread. Reading in slices bounds that wait by the driver's decision to end the step.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(ref, timeout=min(GET_POLL_S, max(0.0, deadline - time.monotonic())))
        except GetTimeoutError:
            if gen.stopped:
                raise StaleGenerationError(f"generation {gen.number} was stopped while reading {what}") from None
            if time.monotonic() >= deadline:
                raise ClusterError(f"{what} from another node's shard did not arrive within {timeout_s:g} s "
                                   f"(generation {gen.number})") from None


def split_threads(cores: int, sums: bool) -> tuple[int, int]:
    """(optimizer, sum) intra-op threads of a shard given `cores` in all: disjoint teams where the shard `sums`
    gradients (several local workers or nodes) and has cores to split, else the optimizer's count for both."""
    if not sums or cores < 4:
        return cores, cores
    sum_threads = min(SUM_THREADS, cores // 4)
    return cores - sum_threads, sum_threads
