"""A worker's gradients on their way into its node's arena: where each lands, its copy out of the GPU, and the
shard's acknowledgement.

The engine hands each finished gradient over on the device (`copies_out`) and goes on launching the backward. A
ship thread finds room for it in the arena (the node's first worker lands it whole, in the unit's slot or, for a unit
another node owns, in the node's pool; each further worker in a ring of its own, in pieces), copies it there on a copy stream of its own, tells the node's coordinator shard where
it landed (a one-way `put_grad`, a few bytes) and frees the device copy. An ack thread waits, bounded, for the
shard's acknowledgement in the arena (asleep on the arena's bell, never polling) and frees that part of the ring or
pool. The waits left on the engine's thread are for room on the device (gradients held there before they land are
at most a ring's worth, two layers', what the engine's device plan keeps for gradients on their way out, or one
gradient where it is larger) and the step's `flush`; each is bounded and names the worker, the unit and what it
waited for.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import ray
import torch
from ray.exceptions import RayActorError

from mt_ray.cluster.arena import ACK_WORDS, SLOT, NodeArena
from mt_ray.cluster.errors import ClusterError, StaleGenerationError
from mt_ray.errors import ModelNotSupportedError

CHECK_CALL_S = 0.1  # how often a wait for an acknowledgement checks that the report itself did not fail


class LandingBuffers:
    """Where each gradient's device->host copy lands in the arena.

    The node's first worker lands every gradient whole: a unit its node's shard owns in the unit's slot, where the
    shard adds the others' to it (a lone worker's is used as it is); a unit another node owns in the node's pool, where
    its node sum is made and sent on. Each further worker lands in a ring of its own, in pieces of a quarter of it
    (`ArenaLayout.pieces`). Pool and rings are handed out first in, first out, and freed as the shard acknowledges
    the report (a ring piece once summed, a pool landing once its sum is put for the owner); a full one holds the
    ship thread (never the engine's) until then, bounded by `timeout_s`. The engine sees only `close`.
    """

    def __init__(self, arena: NodeArena, local_rank: int, numels: dict[str, int], timeout_s: float):
        self.arena = arena
        self.numels = numels
        self.whole = local_rank == 0  # the first worker lands whole gradients, in slots and the pool
        self.space = arena.pool() if self.whole else arena.ring(local_rank)  # handed out first in, first out
        self.what = "the node's gradient pool" if self.whole else "this worker's gradient ring"
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._live: deque[list] = deque()  # [(unit, piece start), ring lo, ring hi, freed], oldest first

    def pieces(self, unit: str) -> list[tuple[int, int]]:
        n = self.numels[unit]
        return [(0, n)] if self.whole else self.arena.layout.pieces(n)

    def acquire(self, unit: str, lo: int, hi: int) -> tuple[torch.Tensor, int]:
        """Room for elements [lo, hi) of `unit`'s gradient: the host view, and where it is (SLOT, or its offset in
        the pool or ring, as the shard's `put_grad` takes it)."""
        if self.whole and unit in self.arena.layout.grad_offsets:
            return self.arena.grad(unit), SLOT
        n = hi - lo
        with self._cond:
            if not self._cond.wait_for(lambda: self._fit(n) is not None, timeout=self.timeout_s):
                raise ClusterError(f"no room in {self.what} for {unit}'s piece at {lo} within "
                                   f"cluster.step_timeout_s={self.timeout_s:g} s: the coordinator shard has not summed "
                                   "(or sent on) the gradients before it")
            at = self._fit(n)
            self._live.append([(unit, lo), at, at + n, False])
        return self.space[at : at + n], at

    def release(self, unit: str, lo: int) -> None:
        """The shard is done with the piece of `unit` starting at `lo`: its part of the ring may be reused."""
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
            self._cond.notify_all()

    def close(self) -> None:
        """Nothing to free: the arena belongs to the node's shard."""

    def _fit(self, n: int) -> int | None:
        """Where `n` contiguous elements are free after the newest live gradient, wrapping once; None if nowhere."""
        size = self.space.numel()
        if not self._live:
            return 0 if n <= size else None
        tail, head = self._live[0][1], self._live[-1][2]
        if head > tail:  # live gradients lie in [tail, head): free after head, and before tail
            return head if size - head >= n else (0 if tail >= n else None)
        return head if tail - head >= n else None  # wrapped: free between head and tail


@dataclass
class _Report:
    """One `put_grad` on its way: the shard acknowledges its `seq` once it is summed."""

    generation: int
    seq: int
    unit: str
    held: int | None  # the start of a piece of the ring or pool, freed on acknowledgement; None: a slot, or unused
    call: ray.ObjectRef
    token: int  # its place in `ArenaGrads._inflight`


class InFlight:
    """Gradients handed over and not yet done with, oldest first, each with what it waits for: what `flush` waits
    on, and what its error names."""

    def __init__(self):
        self._cond = threading.Condition()
        self._items: dict[int, tuple[str, str]] = {}  # token -> (unit, what it waits for), in hand-over order
        self._next = 0

    def add(self, unit: str, waits_for: str) -> int:
        with self._cond:
            token, self._next = self._next, self._next + 1
            self._items[token] = (unit, waits_for)
            return token

    def done(self, token: int) -> None:
        with self._cond:
            del self._items[token]
            self._cond.notify_all()

    def wait_empty(self, timeout_s: float) -> tuple[str, str] | None:
        """None once nothing is in flight; else, after `timeout_s`, the oldest (unit, what it waits for)."""
        with self._cond:
            if self._cond.wait_for(lambda: not self._items, timeout=timeout_s):
                return None
            return next(iter(self._items.values()))


class ArenaGrads:
    """GradSink (`copies_out`): lands each gradient in the arena from the ship thread and reports it to the shard."""

    copies_out = True

    def __init__(self, shard, rank: int, local_rank: int, generation: int, weights, landing: LandingBuffers,
                 unit_order: list[str], timeout_s: float, device: torch.device):
        self.shard = shard
        self.rank, self.local_rank = rank, local_rank
        self.generation = generation
        self.weights = weights
        self.landing = landing
        self.arena = landing.arena
        self.unit_order = unit_order
        self.timeout_s = timeout_s
        self.step = 0
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # Device bytes of gradients handed over and not yet landed: at most a ring's (or one gradient's) worth.
        layout = self.arena.layout
        self.device_cap = layout.ring_numel * layout.grad_dtype.itemsize
        self._held = 0
        self._held_cond = threading.Condition()
        self._seq = 0
        self._outstanding = threading.Semaphore(ACK_WORDS - 1)  # reports not yet acknowledged, one word each
        self._norm: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self._ship: queue.Queue = queue.Queue()
        self._acks: queue.Queue = queue.Queue()
        self._inflight = InFlight()
        self._error: BaseException | None = None
        threading.Thread(target=self._ship_loop, name="mt-ray-grad-ship", daemon=True).start()
        threading.Thread(target=self._ack_loop, name="mt-ray-grad-ack", daemon=True).start()

    # ------------------------------------------------------------------ the engine's side

    def submit(self, unit: str, grad: torch.Tensor | None, landed: torch.cuda.Event | None, lr: float,
               skip: tuple[tuple[int, int], ...] = ()) -> None:
        """Only for a unit this worker's rows did not use (`grad` None: a vision unit, no image): the shard is told."""
        self._raise_if_failed()
        if grad is not None:
            raise ClusterError("a data-parallel worker copies its gradients out itself (submit_device)")
        token = self._inflight.add(unit, "its report to the coordinator shard")
        self._ship.put((self.generation, self.step, unit, None, None, token))

    def submit_device(self, unit: str, grad: torch.Tensor, ready: torch.cuda.Event | None, lr: float,
                      skip: tuple[tuple[int, int], ...] = ()) -> None:
        """Queue `grad` (on the device, complete once `ready` has) for landing; waits only while the gradients held
        on the device for landing would pass `device_cap`. `skip` (tensors without a gradient) is refused."""
        self._raise_if_failed()
        if skip:
            raise ModelNotSupportedError(
                f"unit {unit} has tensors that got no gradient (a vision tower's tensors get_image_features never "
                "reads); a data-parallel run does not yet leave them untouched as torch's AdamW does, it would decay "
                "them; keep model.freeze_vision_tower: true, or train on one GPU")
        nbytes = grad.numel() * grad.element_size()
        with self._held_cond:
            room = self._held_cond.wait_for(lambda: self._held == 0 or self._held + nbytes <= self.device_cap
                                            or self._error is not None, timeout=self.timeout_s)
            if not room:
                raise ClusterError(f"worker {self.rank}: {self._held / 2**20:.0f} MiB of gradients waited on the GPU "
                                   f"for room in the node's arena for cluster.step_timeout_s={self.timeout_s:g} s "
                                   f"(before {unit}'s): the coordinator shard is not summing")
            self._held += nbytes
        token = self._inflight.add(unit, "room in the node's arena and its copy there")
        self._ship.put((self.generation, self.step, unit, grad, ready, token))

    def end_step(self, norm_sq: torch.Tensor, ready: torch.cuda.Event | None, lr: float) -> None:
        """Kept: where this worker's engine holds the node's only gradients (one lander on one node), its GPU's norm
        is the global one (the shards' clip uses it)."""
        self._norm = (norm_sq, ready)

    def norm_sq(self) -> float:
        norm_sq, ready = self._norm
        if ready is not None:
            ready.synchronize()  # the norm's device->host copy has landed
        return float(norm_sq)

    def wait_updated(self, unit: str, version: int) -> None:
        self.weights.wait_updated(unit, version)

    def flush(self) -> None:
        """Return once the shard has summed every gradient submitted so far (bounded by `timeout_s`)."""
        self.flush_quietly()
        self._raise_if_failed()

    def rejoin(self, generation: int) -> None:
        """Serve a new generation: its reports are counted from 0, as the shard's acknowledgements are."""
        self.flush_quietly()
        self.generation, self._seq, self._error = generation, 0, None
        self.landing.reset()

    def flush_quietly(self) -> None:
        """Let the last reports drain (each ends as its generation's state tells), ignoring their errors; bounded
        by `timeout_s`, naming the oldest gradient still in flight and what it waits for."""
        oldest = self._inflight.wait_empty(self.timeout_s)
        if oldest is not None:
            unit, waits_for = oldest
            raise ClusterError(f"worker {self.rank}: step {self.step}'s gradients were not all summed within "
                               f"cluster.step_timeout_s={self.timeout_s:g} s; the oldest, {unit}'s, waits for "
                               f"{waits_for}")

    def close(self) -> None:
        self._ship.put(None)

    # ------------------------------------------------------------------ the ship and ack threads

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, (RayActorError, ClusterError)):
                raise error  # as it came: a lost shard stays a RayActorError for the driver
            raise ClusterError("handing a gradient to the coordinator shard failed") from error

    def _ship_loop(self) -> None:
        while (item := self._ship.get()) is not None:
            generation, step, unit, grad, ready, token = item
            item = None
            nbytes = 0 if grad is None else grad.numel() * grad.element_size()
            try:
                if generation != self.generation:
                    continue  # a stopped generation's gradient: nothing waits for it
                if grad is None:  # unused: one report for the whole unit
                    self._report(generation, step, unit, None, None, None)
                    continue
                for lo, hi in self.landing.pieces(unit):
                    host, where = self.landing.acquire(unit, lo, hi)
                    self._copy(host, grad[lo:hi], ready)
                    self._report(generation, step, unit, where, None if self.landing.whole else lo,
                                 None if where == SLOT else lo)
            except BaseException as e:  # surfaced to the engine thread by submit/flush
                self._error = e
            finally:
                grad = None  # the device copy goes back to the allocator: its copies have run (synchronised)
                if nbytes:
                    with self._held_cond:
                        self._held -= nbytes
                        self._held_cond.notify_all()
                self._inflight.done(token)  # after its reports are in flight: flush never sees a gap

    def _copy(self, host: torch.Tensor, grad: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        """Copy a piece out on this worker's copy stream and wait for it (this thread only)."""
        if self.copy_stream is None:
            host.copy_(grad)
            return
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(ready)  # the gradient is complete on the compute stream
            host.copy_(grad, non_blocking=True)  # a DMA into the page-locked arena
            landed = torch.cuda.Event()
            landed.record(self.copy_stream)
        landed.synchronize()  # the piece is in the arena before the shard hears of it

    def _report(self, generation: int, step: int, unit: str, where: int | None, piece: int | None,
                held: int | None) -> None:
        """Tell the shard where `unit`'s gradient (its `piece`; None: whole) landed; `held`: the piece of the ring or
        pool it holds until the acknowledgement."""
        if not self._outstanding.acquire(timeout=self.timeout_s):  # every acknowledgement word is in use
            raise ClusterError(f"worker {self.rank}: {ACK_WORDS - 1} reports went unacknowledged for "
                               f"cluster.step_timeout_s={self.timeout_s:g} s (before {unit}'s)")
        seq, self._seq = self._seq, self._seq + 1
        call = self.shard.put_grad.remote(generation, step, self.rank, unit, where, piece, seq)
        token = self._inflight.add(unit, f"the coordinator shard's sum (report {seq})")
        self._acks.put(_Report(generation, seq, unit, held, call, token))

    def _ack_loop(self) -> None:
        while True:
            report: _Report = self._acks.get()
            try:
                self._wait_acked(report)
                if report.held is not None:
                    self.landing.release(report.unit, report.held)
            except StaleGenerationError:
                pass  # the generation was stopped: the driver decides what its step becomes
            except BaseException as e:
                self._error = e
            finally:
                self._outstanding.release()
                self._inflight.done(report.token)

    def _wait_acked(self, report: _Report) -> None:
        """Bounded: the shard's acknowledgement of `report`, its generation's end, or its report's own failure
        (looked at every CHECK_CALL_S: a lost shard)."""
        running = self.arena.running_check(report.generation)

        def check() -> None:
            if report.generation != self.generation:
                raise StaleGenerationError(f"generation {report.generation} was stopped")
            running()

        deadline = time.monotonic() + self.timeout_s
        while not self.arena.wait_until(lambda: self.arena.acked(self.local_rank, report.seq),
                                        min(CHECK_CALL_S, max(0.0, deadline - time.monotonic())), check):
            if time.monotonic() > deadline:
                raise ClusterError(f"worker {self.rank}: the coordinator shard did not sum its gradient of "
                                   f"{report.unit} (report {report.seq}) within cluster.step_timeout_s="
                                   f"{self.timeout_s:g} s")
            if ray.wait([report.call], timeout=0)[0]:  # the report itself may have failed (a lost shard)
                ray.get(report.call)
