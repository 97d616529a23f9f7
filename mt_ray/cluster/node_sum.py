"""A node's gradient sum: the workers' gradients summed in the arena, in rank order, then the nodes' partial sums of
the units this node owns in node order. Owned by the coordinator shard (mt_ray.cluster.shard), which hands each
owned unit's sum to its updates (mt_ray.cluster.updates).

A worker tells the shard where each unit gradient landed (`put_grad`, a few bytes): the node's first worker lands it
whole, in the unit's slot where the node owns it and in the node's pool where another node does; the others in
pieces in their rings. Once every local worker's piece of a range is in, the range is summed in fp32, in rank order,
and rounded once into the first worker's landing. The node's sum of a unit another shard owns is sent to that owner
once (`ray.put` copies it out of the pool, whose place is then free): each node's gradients cross the network once,
at most FORWARD_INFLIGHT unsummed per owner. An owner adds the nodes' partial sums (node order) in the unit's slot
and hands it to the optimizer.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import ray
import torch
from ray.exceptions import GetTimeoutError

from mt_ray.cluster.arena import FORWARD_INFLIGHT, SLOT, NodeArena
from mt_ray.cluster.errors import ClusterError, StaleGenerationError
from mt_ray.cluster.grad_sum import sum_in_order, use_sum_threads
from mt_ray.cluster.shard_state import (
    GET_POLL_S,
    PEER_WAIT_S,
    Generation,
    Landing,
    ShardStatus,
    ShardUnits,
    read_unless_stopped,
)
from mt_ray.cluster.wire import from_numpy, to_numpy

# An owned unit's sum, ready for the optimizer: (generation, step, unit, summed gradient or None, norm² or None)
ToOptimizer = Callable[[Generation, int, str, torch.Tensor | None, torch.Tensor | None], None]


class NodeSum:
    """The node's sums, on one reduce thread (with an intra-op team of `sum_threads`) and one forwarding thread.

    `to_optimizer` takes each owned unit's sum of every node; `gpu_norm`: a lone lander on one node, whose engine's
    GPU norm is the global one (the sum takes none of its own)."""

    def __init__(self, units: ShardUnits, arena: NodeArena, status: ShardStatus, grad_dtype: torch.dtype,
                 sum_threads: int, gpu_norm: bool, to_optimizer: ToOptimizer):
        self.units = units
        self.arena = arena
        self.status = status
        self.grad_dtype = grad_dtype
        self.gpu_norm = gpu_norm
        self.to_optimizer = to_optimizer
        self.peers: list = []  # every shard's handle, by shard index
        self.busy_s = 0.0
        # The sums run on numba's team, sized for the reduce thread alone (numba's count holds per thread).
        self._reducer = ThreadPoolExecutor(1, thread_name_prefix="mt-ray-reduce", initializer=use_sum_threads,
                                           initargs=(sum_threads,))
        self._forwarder = ThreadPoolExecutor(1, thread_name_prefix="mt-ray-forward")  # partial sums to other nodes

    def ranks_in(self, gen: Generation, step: int) -> dict[str, list[int]]:
        """Units of `step` partly landed here, each with the local workers whose gradient of it is in (lock held)."""
        return {u: landing.ranks_in() for (s, u), landing in gen.sums.local.items() if s == step}

    def stop(self, gen: Generation, timeout_s: float = PEER_WAIT_S) -> None:
        """`gen` is stopped: peers waiting for a sum that will not come are answered, and the sums already queued
        finish (bounded)."""
        with self.status.cond:
            for summed in gen.sums.partials_summed.values():
                summed.set()
        try:
            self._reducer.submit(lambda: None).result(timeout=timeout_s)
        except TimeoutError:
            raise ClusterError(f"shard {self.units.shard}: the sums queued before generation {gen.number} stopped "
                               f"did not finish within {timeout_s:g} s") from None

    def wait_forwarded(self, gen: Generation, step: int, timeout_s: float) -> None:
        """The owners have this node's partial sums of `step` (surfaces their errors), within `timeout_s`."""
        try:
            ray.get(gen.sums.forwarded.pop(step, []), timeout=timeout_s)
        except GetTimeoutError:
            raise ClusterError(f"shard {self.units.shard}: another node's shard did not take step {step}'s partial "
                               f"sums within {timeout_s:g} s (cluster.step_timeout_s)") from None

    def close(self) -> None:
        self._reducer.shutdown(wait=False)
        self._forwarder.shutdown(wait=False)

    def put_grad(self, generation: int, step: int, rank: int, unit: str, where: int | None,
                 piece: int | None, seq: int) -> None:
        """Local worker `rank`'s gradient of `unit` has landed: in the unit's slot (`where` SLOT), at element
        `where` of the node's pool (the first worker's of a unit another node owns) or of its ring, or nowhere
        (None): its rows did not use the unit (a vision unit, no image).
        `piece`: the start of the piece of the gradient it reports (a ring's, `ArenaLayout.pieces`); None: all.

        Returns at once: the sum is queued once every local worker's piece is in, and the arena acknowledges the
        worker's report `seq` when it is done (a ring piece once summed, so that part of the ring may be reused; a
        whole landing once the node is done with the unit's sum: a pool landing once it is put for the owner).
        """
        with self.status.cond:
            if self.status.stale(generation):
                return
            gen = self.status.gen
            local = rank % self.units.num_local
            landing = gen.sums.local.get((step, unit))
            if landing is None:
                ends = self.units.pieces[unit]
                landing = gen.sums.local[(step, unit)] = Landing({lo: {} for lo in ends}, ends, len(ends))
            if piece is None:
                landing.unit_seqs.append((local, seq))
            else:
                landing.piece_seqs.setdefault(piece, []).append((local, seq))
            for lo in landing.ends if piece is None else [piece]:
                got = landing.got[lo]
                got[local] = where
                if len(got) == self.units.num_local:
                    self._on_piece(gen, step, unit, lo, landing)

    def put_partial(self, generation: int, step: int, node: int, unit: str, partial: list[ray.ObjectRef | None]) -> None:
        """Another node's sum of its workers' gradients of a unit this shard owns, as `[ref]` (`[None]`: none of
        them used the unit).

        Fetched here, on this call's thread, so partials from several nodes arrive at once, as Ray
        fetches task arguments; but where a dying owner cannot hang the fetch (`read_unless_stopped`).
        """
        gen = self.status.generation_of(generation)
        if gen is None:
            return
        try:
            parts = [] if partial[0] is None else [
                from_numpy(read_unless_stopped(gen, partial[0], f"node {node}'s partial sum of {unit}"), self.grad_dtype)]
        except StaleGenerationError:
            return
        with self.status.cond:
            if gen is not self.status.gen or gen.stopped:
                return
            self._add_contribution(gen, step, unit, node, parts)
            summed = gen.sums.partials_summed.setdefault((step, unit), threading.Event())
        del parts
        # Answered once the unit's sum has read it: the sender keeps FORWARD_INFLIGHT partials unsummed here at most,
        # so the object stores never hold more than that many unit gradients per peer (nothing spills).
        if not summed.wait(PEER_WAIT_S):
            raise ClusterError(f"shard {self.units.shard}: node {node}'s partial sum of {unit} (step {step}) was not "
                               f"summed here within {PEER_WAIT_S:g} s: the other nodes' partials of it did not come")

    def _landed(self, unit: str, rank: int, where: int, lo: int, hi: int) -> torch.Tensor:
        """Where local worker `rank`'s elements [lo, hi) of `unit`'s gradient landed: its slot, the pool (the first
        worker's of a unit another node owns, whole from `where`) or the worker's ring (the piece at `where`)."""
        if where == SLOT:
            return self.arena.grad(unit)[lo:hi]
        if rank == 0:
            return self.arena.pool()[where + lo : where + hi]
        return self.arena.ring(rank)[where : where + hi - lo]

    def _node_sum(self, unit: str, landing: Landing) -> torch.Tensor:
        """Where the node's sum of `unit` is made: the first worker's landing (its slot, or its place in the pool);
        where that worker's rows did not use the unit (a vision unit, no image in its rows) and the node does not own
        it, a buffer of its own, this step only."""
        first = next(iter(landing.got.values())).get(0)
        if first is not None:
            return self._landed(unit, 0, first, 0, self.units.spec.unit(unit).numel)
        if unit in self.arena.layout.grad_offsets:
            return self.arena.grad(unit)
        return torch.empty(self.units.spec.unit(unit).numel, dtype=self.grad_dtype)

    def _on_piece(self, gen: Generation, step: int, unit: str, lo: int, landing: Landing) -> None:
        """Every local worker's piece at `lo` of `unit` is in (lock held): a lone worker's gradient is its node's
        sum as it lies; several workers' pieces are summed on the reduce thread into the unit's slot (a unit this
        node owns) or its place in the pool (another node's)."""
        if self.units.num_local == 1:
            del gen.sums.local[(step, unit)]
            used = landing.got[lo][0] is not None
            self._on_local_sum(gen, step, unit, self._node_sum(unit, landing) if used else None, None,
                               landing.unit_seqs)
        else:
            if landing.dest is None:
                landing.dest = self._node_sum(unit, landing)
            gen.sums.acks[(step, unit, lo)] = landing.piece_seqs.pop(lo, [])
            self._reducer.submit(self._guarded, gen, (step, unit, lo), self._sum_piece, lo, landing)

    def _sum_piece(self, gen: Generation, step: int, unit: str, lo: int, landing: Landing) -> None:
        """Sum the local workers' piece at `lo` of `unit` into the slot, in rank order; the last piece's sum
        hands the node's sum on."""
        got, hi = landing.got[lo], landing.ends[lo]
        parts = [self._landed(unit, r, got[r], lo, hi) for r in sorted(got) if got[r] is not None]
        norm_sq = sum_in_order(parts, landing.dest[lo:hi]) if parts else None
        with self.status.cond:
            if norm_sq is not None:
                landing.norm_sq += norm_sq
                landing.used = True
            landing.left -= 1
            if landing.left == 0 and gen.sums.local.pop((step, unit), None) is landing:
                self._on_local_sum(gen, step, unit, landing.dest if landing.used else None, landing.norm_sq,
                                   landing.unit_seqs)

    def _on_local_sum(self, gen: Generation, step: int, unit: str, node_sum: torch.Tensor | None,
                      norm_sq: torch.Tensor | None, seqs: list[tuple[int, int]]) -> None:
        """The node's sum of `unit` is in `node_sum` (its slot or pool place; None: no worker's rows used the unit)
        (lock held): add it as this node's part, or send it on to the unit's owner. `norm_sq`: the sum's, where
        several local workers made it; `seqs`: the whole landings' reports, acknowledged once the node is done with
        the unit (a pool landing's place is then free again)."""
        gen.sums.acks[(step, unit)] = seqs
        used = node_sum is not None
        parts = [node_sum] if used else []
        if norm_sq is not None and used:
            gen.sums.local_norms[(step, unit)] = norm_sq
        owner = self.units.plan.owner(unit)
        if owner == self.units.shard:
            self._add_contribution(gen, step, unit, self.units.shard, parts)
        else:
            # On the forwarding thread: it may wait for the owner to sum earlier partials, and the sums here go on.
            self._forwarder.submit(self._guarded, gen, (step, unit), self._forward_partial, owner, parts)

    def _add_contribution(self, gen: Generation, step: int, unit: str, node: int, parts: list[torch.Tensor]) -> None:
        """A node's contribution to an owned unit (lock held); the last one starts the sum."""
        got = gen.sums.remote.setdefault((step, unit), {})
        got[node] = parts
        if len(got) < self.units.num_shards:
            return
        del gen.sums.remote[(step, unit)]
        # Node order, each node's workers in rank order: the sum never depends on arrival order.
        ordered = [t for n in range(self.units.num_shards) for t in got[n]]
        self._reducer.submit(self._guarded, gen, (step, unit), self._sum_owned, ordered)

    def _guarded(self, gen: Generation, key: tuple, fn: Callable, *args) -> None:
        """Run one sum on the reduce thread; whatever happens, the reports it completes (`key`: (step, unit), or
        (step, unit, piece start)) are acknowledged (a failure also marks the arena FAILED, which ends their wait)."""
        t0 = time.perf_counter()
        try:
            fn(gen, *key[:2], *args)
            self.busy_s += time.perf_counter() - t0
        except BaseException as e:
            self.status.fail(e)
        finally:
            with self.status.cond:
                if len(key) == 2 and (summed := gen.sums.partials_summed.pop(key, None)) is not None:
                    summed.set()  # the other nodes' partials of this unit are read
                seqs = gen.sums.acks.pop(key, [])
                if gen is self.status.gen and not gen.stopped:  # a stopped generation's workers stop waiting anyway
                    for local, seq in seqs:
                        self.arena.ack(local, seq)

    def _forward_partial(self, gen: Generation, step: int, unit: str, owner: int, parts: list[torch.Tensor]) -> None:
        """This node's sum of a unit another shard owns (in the pool; `parts` empty: unused) goes to the owner, once
        fewer than FORWARD_INFLIGHT of the partials sent there are still unsummed (bounded: PEER_WAIT_S)."""
        gen.sums.local_norms.pop((step, unit), None)  # the owner takes the norm of the nodes' sum
        inflight = gen.sums.forward_inflight.setdefault(owner, deque())
        deadline = time.monotonic() + PEER_WAIT_S
        while len(inflight) >= FORWARD_INFLIGHT:
            if ray.wait([inflight[0]], timeout=GET_POLL_S)[0]:
                inflight.popleft()
            elif gen.stopped:
                return  # the driver decides what this step becomes
            elif time.monotonic() > deadline:
                raise ClusterError(f"shard {owner} did not sum this node's partial gradients within {PEER_WAIT_S:g} s")
        # The one copy of this node's gradient that crosses the network.
        ref = ray.put(to_numpy(parts[0])) if parts else None  # copied out: the pool's place is free once this returns
        call = self.peers[owner].put_partial.remote(gen.number, step, self.units.shard, unit, [ref])
        inflight.append(call)
        with self.status.cond:
            gen.sums.forwarded.setdefault(step, []).append(call)

    def _sum_owned(self, gen: Generation, step: int, unit: str, parts: list[torch.Tensor]) -> None:
        """Every node's sum of an owned unit is in (`parts`, node order; this node's is its slot)."""
        local_norm = gen.sums.local_norms.pop((step, unit), None)
        if not parts:  # no worker's rows used the unit (a vision unit in a step without images): like torch with a
            self.to_optimizer(gen, step, unit, None, torch.zeros(()))  # None `.grad`, the unit and its count stay
            return
        slot = self.arena.grad(unit)
        if len(parts) > 1:  # several nodes: theirs added to this one's, in node order
            norm_sq = sum_in_order(parts, slot)
        elif parts[0].data_ptr() == slot.data_ptr():  # this node's workers' alone, already summed in the slot
            norm_sq = local_norm if local_norm is not None else None if self.gpu_norm else sum_in_order(parts, None)
        else:  # one other node's alone
            norm_sq = sum_in_order(parts, slot)
        del parts  # other nodes' objects can be freed now
        self.to_optimizer(gen, step, unit, slot, norm_sq)
